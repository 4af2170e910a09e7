"""Check the GPU image's pins against what the project runs (nothing here can build the image, so
its pins must be right by construction):

    python -m tools.check_image_pins

- Transformer Engine (``ARG TE_VERSION`` in the Dockerfile) inside the range the installed
  megatron-core declares for it (its ``dev`` extra);
- megatron-core in ``docker/requirements.txt`` equal to the installed one (what the tests ran)
  and inside setup.py's requirement;
- SGLang (``ARG SGLANG_VERSION``) equal to the version the client targets
  (``megatron_gspo.rollout.sglang.facade.SGLANG_VERSION``);
- Transformer Engine also inside setup.py's ``gpu`` extra, and setup.py's torch floor equal to
  ``megatron_gspo.TORCH_MIN`` (what ``python -m megatron_gspo`` checks at start);
- every requirement of setup.py pinned in ``docker/requirements.txt`` inside its range (the
  image installs the package with ``--no-deps``), but those the base image provides
  (``BASE_IMAGE_PROVIDES``).

Prints one line per problem and exits 1, or prints the pins and exits 0.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from typing import Optional

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# setup.py's requirements that NGC PyTorch ships (and its pip constraints hold): not re-pinned.
BASE_IMAGE_PROVIDES = ("torch", "numpy", "ninja")


def dockerfile_args(text: str) -> dict:
    """``ARG NAME=value`` defaults of a Dockerfile."""
    return dict(re.findall(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)=(\S+)\s*$", text, re.M))


def requirement_pins(text: str) -> dict:
    """{normalised name: version} of the ``name==version`` lines of a requirements file."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            pins[_norm(req.name)] = exact[0]
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_range(requires: list, dependency: str, extra: Optional[str] = None) -> SpecifierSet:
    """The version range a package's metadata declares for ``dependency`` (in ``extra``)."""
    for line in requires:
        req = Requirement(line)
        if _norm(req.name) != _norm(dependency):
            continue
        if extra is None or (req.marker is not None and req.marker.evaluate({"extra": extra})):
            return req.specifier
    raise LookupError(f"no requirement on {dependency} (extra {extra}) in the metadata")


def setup_requirement(setup_text: str, name: str) -> SpecifierSet:
    match = re.search(rf'"({re.escape(name)}[^"]*)"', setup_text)
    if not match:
        raise LookupError(f"setup.py does not require {name}")
    return Requirement(match.group(1)).specifier


def install_requires(setup_text: str) -> list:
    """The requirements in setup.py's ``install_requires=[...]``."""
    match = re.search(r"install_requires=\[(.*?)\n\s*\],", setup_text, re.S)
    if not match:
        raise LookupError("setup.py has no install_requires=[...]")
    return [Requirement(r) for r in re.findall(r'"([^"]+)"', match.group(1))]


def problems(dockerfile: str, requirements: str, setup_text: str, *, megatron_requires: list,
             megatron_installed: str, sglang_client: str, torch_min: str) -> list:
    """One line per pin that does not fit."""
    args, pins, out = dockerfile_args(dockerfile), requirement_pins(requirements), []
    te_range = declared_range(megatron_requires, "transformer-engine", extra="dev")
    te = args.get("TE_VERSION")
    if te is None:
        out.append("Dockerfile: no ARG TE_VERSION=...")
    elif not te_range.contains(Version(te), prereleases=True):
        out.append(f"Dockerfile: TE_VERSION={te} is outside megatron-core {megatron_installed}'s "
                   f"transformer-engine{te_range}")
    te_extra = setup_requirement(setup_text, "transformer-engine")
    if te is not None and not te_extra.contains(Version(te), prereleases=True):
        out.append(f"Dockerfile: TE_VERSION={te} is outside setup.py's gpu extra "
                   f"transformer-engine{te_extra}")
    requires = install_requires(setup_text)
    torch_floor = next(r.specifier for r in requires if _norm(r.name) == "torch")
    if str(torch_floor) != f">={torch_min}":
        out.append(f"setup.py: torch{torch_floor}, but megatron_gspo.TORCH_MIN is {torch_min}")
    mcore = pins.get("megatron-core")
    if mcore != megatron_installed:
        out.append(f"docker/requirements.txt: megatron-core=={mcore}, but the tests run "
                   f"megatron-core {megatron_installed}")
    for req in requires:
        name = _norm(req.name)
        if name in BASE_IMAGE_PROVIDES:
            continue
        if name not in pins:
            out.append(f"docker/requirements.txt: no pin of {req.name} (setup.py requires {req})")
        elif not req.specifier.contains(pins[name], prereleases=True):
            out.append(f"docker/requirements.txt: {req.name}=={pins[name]} is outside setup.py's "
                       f"{req}")
    sglang = args.get("SGLANG_VERSION")
    if sglang != sglang_client:
        out.append(f"Dockerfile: SGLANG_VERSION={sglang}, but the client targets SGLang "
                   f"{sglang_client} (megatron_gspo/rollout/sglang/facade.py SGLANG_VERSION)")
    return out


def check_repository(root: str = ROOT) -> tuple[list, dict]:
    from megatron_gspo import TORCH_MIN
    from megatron_gspo.rollout.sglang.facade import SGLANG_VERSION

    def read(*parts):
        with open(os.path.join(root, *parts)) as f:
            return f.read()

    dockerfile = read("Dockerfile")
    found = problems(dockerfile, read("docker", "requirements.txt"), read("setup.py"),
                     megatron_requires=importlib.metadata.requires("megatron-core") or [],
                     megatron_installed=importlib.metadata.version("megatron-core"),
                     sglang_client=SGLANG_VERSION, torch_min=TORCH_MIN)
    return found, dockerfile_args(dockerfile)


def main() -> int:
    found, args = check_repository()
    for line in found:
        print(line)
    if not found:
        print("image pins fit: " + ", ".join(f"{k}={v}" for k, v in sorted(args.items())))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
