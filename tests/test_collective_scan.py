"""The package's collectives are device-true and never skipped for one-rank groups (AST scan).

On GPU every process group is NCCL, which rejects host tensors; a collective guarded by "the group
has more than one rank" hides such a bug from every one-GPU run. Two rules, checked on the source
of ``megatron_gspo/`` and ``moe/`` (``megatron_gspo/distributed/comm.py`` builds its tensors on the run's
device and is the place for small reductions):

1. no torch.distributed collective (or its autograd form, torch.distributed.nn) receives a
   tensor that the same function built on the host (a torch factory call without ``device=``,
   or ``.cpu()``);
2. no collective sits under an ``if`` whose whole test is a size-one check (``world_size > 1``,
   ``ctx.dp > 1``, ``group.size() == 1``, ...).
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = ("megatron_gspo", "moe")
EXEMPT = {"megatron_gspo/distributed/comm.py"}
COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "send", "recv",
               "isend", "irecv", "all_to_all", "all_to_all_single"}
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor", "rand", "randn",
             "randint", "linspace", "eye"}
SIZE_NAMES = {"dp", "tp", "pp", "cp", "ep", "etp", "world_size"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def dist_aliases(tree: ast.AST) -> set:
    """Names a module binds to torch.distributed or its submodules (``dist``, ``dist_nn`` for
    ``torch.distributed.nn.functional``, ...)."""
    names = {"dist"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname for a in node.names
                      if a.asname and a.name.startswith("torch.distributed")}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {a.asname or a.name for a in node.names
                      if f"{node.module}.{a.name}".startswith("torch.distributed")}
    return names


def _is_collective(call: ast.Call, aliases: frozenset = frozenset({"dist"})) -> bool:
    """A collective of torch.distributed or of its autograd functions (torch.distributed.nn)."""
    f = call.func
    if not (isinstance(f, ast.Attribute) and f.attr in COLLECTIVES):
        return False
    base = _dotted(f.value)
    return base in aliases or base.startswith("torch.distributed")


def _host_tensor(node: ast.AST) -> bool:
    """A torch factory call without ``device=``, or ``x.cpu()``."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    f = node.func
    if f.attr == "cpu":
        return True
    return (f.attr in FACTORIES and isinstance(f.value, ast.Name) and f.value.id == "torch"
            and not any(k.arg == "device" for k in node.keywords))


def _size_check(test: ast.AST) -> bool:
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return False
    sides = [test.left, *test.comparators]
    if not any(isinstance(s, ast.Constant) and s.value == 1 for s in sides):
        return False
    for side in sides:
        for node in ast.walk(side):
            if isinstance(node, ast.Attribute) and node.attr in SIZE_NAMES | {"size"}:
                return True
            if isinstance(node, ast.Name) and node.id in SIZE_NAMES:
                return True
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "get_world_size":
                return True
    return False


def violations(source: str, where: str = "<source>") -> list:
    """``where:line: problem`` for every breach of the two rules in ``source``."""
    tree = ast.parse(source)
    aliases = frozenset(dist_aliases(tree))
    out = []
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        host = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and _host_tensor(node.value):
                host |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and _is_collective(node, aliases):
                args = list(node.args)
                for a in list(args):
                    if isinstance(a, (ast.List, ast.Tuple)):
                        args.extend(a.elts)
                for a in args:
                    if _host_tensor(a) or (isinstance(a, ast.Name) and a.id in host):
                        out.append(f"{where}:{node.lineno}: {node.func.attr} on a host tensor "
                                   f"built here; build it on the run's device (megatron_gspo.distributed.comm)")
            if isinstance(node, ast.If) and _size_check(node.test):
                inner = [c for part in node.body + node.orelse for c in ast.walk(part)
                         if isinstance(c, ast.Call) and _is_collective(c, aliases)]
                if inner:
                    out.append(f"{where}:{node.lineno}: collective skipped for a one-rank group; "
                               "call it on every group size")
    return out


def package_files():
    for pkg in SCANNED:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in EXEMPT:
                yield rel, path.read_text()


def test_package_collectives_are_device_true_and_never_skipped():
    files = dict(package_files())
    calls = {}
    for rel, text in files.items():
        tree = ast.parse(text)
        aliases = frozenset(dist_aliases(tree))
        calls[rel] = sum(1 for n in ast.walk(tree)
                         if isinstance(n, ast.Call) and _is_collective(n, aliases))
    assert sum(calls.values()) >= 5, f"the scan saw only {calls} collectives"  # it looks at them
    assert calls["megatron_gspo/models/layers.py"] >= 1  # context parallelism's autograd all-gather
    found = [v for rel, text in files.items() for v in violations(text, rel)]
    assert not found, "\n".join(found)


PLANTED = {
    "host factory": "def f(group):\n    t = torch.tensor([1.0])\n    dist.all_reduce(t, group=group)\n",
    "inline factory": "def f():\n    dist.all_reduce(torch.zeros(2))\n",
    "cpu copy": "def f(x):\n    y = x.cpu()\n    torch.distributed.broadcast(y, src=0)\n",
    "in a list": "def f(parts):\n    t = torch.empty(3)\n    dist.all_gather(parts, t)\n",
    "size guard": "def f(t, ctx):\n    if ctx.dp > 1:\n        dist.all_reduce(t, group=ctx.dp_group)\n",
    "world guard": "def f(t, g):\n    if dist.get_world_size(g) == 1:\n        return t\n"
                   "    else:\n        dist.all_reduce(t, group=g)\n",
    "autograd guard": "import torch.distributed.nn.functional as dist_nn\n"
                      "def f(t, ctx):\n    if ctx.cp > 1:\n        dist_nn.all_gather(t, group=g)\n",
    "autograd host": "from torch.distributed.nn import functional\n"
                     "def f():\n    functional.all_reduce(torch.ones(2))\n",
    "spelled out": "def f():\n    torch.distributed.nn.functional.all_reduce(torch.ones(2))\n",
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_a_planted_violation_is_reported(name):
    assert len(violations(PLANTED[name])) == 1, name


def test_device_tensors_and_pipeline_logic_pass():
    ok = ("def f(ctx, hidden):\n"
          "    t = torch.zeros(2, device=ctx.device)\n"
          "    dist.all_reduce(t)\n"
          "    if ctx.pp > 1 and not ctx.is_first_stage:\n"
          "        dist.recv(hidden, group_src=ctx.pp_rank - 1, group=ctx.pp_group)\n")
    assert violations(ok) == []
