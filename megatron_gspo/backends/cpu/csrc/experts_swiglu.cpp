// A layer's fp32 SwiGLU experts on CPU with whole experts per OpenMP thread
// (megatron_gspo/backends/cpu/kernels.py builds it, backends/cpu/experts.py calls it).
//
// The same per-expert products and elementwise steps as grouped_experts._ExpertsSwiGLU's Python
// loop, but each expert runs entirely on one thread (single-threaded MKL inside the parallel
// region) and the threads take the experts largest first from a shared counter. Against MKL
// splitting every small product over both threads this keeps an expert's rows, weights and
// gradients on one core, with no barrier per product and no static split for a slower core to
// hold up.
//
// Rows are grouped by expert: expert e owns rows [starts[e], ends[e]) of x and of every [T, .]
// buffer. fc1[e] is [2F, H] (gate rows, then up rows), fc2[e] is [H, F].

#include <torch/extension.h>

#include <ATen/core/LegacyTypeDispatch.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <functional>
#include <numeric>
#include <vector>

namespace {

using torch::Tensor;

// fn(e) for every expert, the largest first, each on one thread. Raw OpenMP rather than
// at::parallel_for: that template's lazy thread-count initialisation keeps one flag per shared
// object, so its first call from this library would reset the calling thread's OpenMP count to
// torch's process-wide one (intra_op.pin_to_this_thread sets that to 1 for other threads).
void for_each_expert(const std::vector<int64_t>& starts, const std::vector<int64_t>& ends,
                     const std::function<void(int64_t)>& fn) {
  const int64_t n = static_cast<int64_t>(starts.size());
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return ends[a] - starts[a] > ends[b] - starts[b];
  });
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
#pragma omp parallel num_threads(std::max(1, std::min<int>(omp_get_max_threads(), n)))
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // the caller's Function records
    int64_t i;
    while (!failed.load() && (i = next.fetch_add(1)) < n) {
      try {
        fn(order[i]);
      } catch (...) {
#pragma omp critical(experts_swiglu_error)
        if (!error) error = std::current_exception();
        failed = true;
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

void check(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat,
              "experts_swiglu: ", name, " must be a CPU float32 tensor");
}

void forward(const Tensor& x, const Tensor& probs, const std::vector<int64_t>& starts,
             const std::vector<int64_t>& ends, const std::vector<Tensor>& fc1,
             const std::vector<Tensor>& fc2, Tensor h, Tensor sa, Tensor sb, Tensor g,
             Tensor out) {
  TORCH_CHECK(starts.size() == ends.size() && fc1.size() == starts.size() &&
              fc2.size() == starts.size(), "experts_swiglu: one [start, end) and two weights "
              "per expert");
  check(x, "x");
  check(probs, "probs");
  const int64_t f = h.size(1) / 2;
  for_each_expert(starts, ends, [&](int64_t e) {
    const int64_t r0 = starts[e], r1 = ends[e];
    if (r1 <= r0) return;
    Tensor he = h.slice(0, r0, r1), sae = sa.slice(0, r0, r1), sbe = sb.slice(0, r0, r1);
    Tensor ge = g.slice(0, r0, r1), oute = out.slice(0, r0, r1);
    at::mm_out(he, x.slice(0, r0, r1), fc1[e].t());
    at::silu_out(sae, he.slice(1, 0, f));
    at::mul_out(sbe, sae, he.slice(1, f, 2 * f));
    at::mul_out(ge, sbe, probs.slice(0, r0, r1).unsqueeze(-1));
    at::mm_out(oute, ge, fc2[e].t());
  });
}

// Weight gradients go into wg1[e] / wg2[e]: added (addmm_) where acc1[e] / acc2[e] (a
// main_grad), written otherwise. dprobs is filled when given.
void backward(const Tensor& grad, const Tensor& x, const Tensor& probs, const Tensor& h,
              const Tensor& sa, const Tensor& sb, const Tensor& g,
              const std::vector<int64_t>& starts, const std::vector<int64_t>& ends,
              const std::vector<Tensor>& fc1, const std::vector<Tensor>& fc2,
              std::vector<Tensor> wg1, std::vector<Tensor> wg2, const std::vector<bool>& acc1,
              const std::vector<bool>& acc2, Tensor dg, Tensor dh, Tensor dx,
              c10::optional<Tensor> dprobs) {
  const size_t n = starts.size();
  TORCH_CHECK(ends.size() == n && fc1.size() == n && fc2.size() == n && wg1.size() == n &&
              wg2.size() == n && acc1.size() == n && acc2.size() == n,
              "experts_swiglu: one [start, end), two weights and two gradients per expert");
  check(grad, "grad");
  const int64_t f = h.size(1) / 2;
  for_each_expert(starts, ends, [&](int64_t e) {
    const int64_t r0 = starts[e], r1 = ends[e];
    Tensor gr = grad.slice(0, r0, r1), dge = dg.slice(0, r0, r1), ge = g.slice(0, r0, r1);
    Tensor xe = x.slice(0, r0, r1), dhe = dh.slice(0, r0, r1);
    if (r1 > r0) at::mm_out(dge, gr, fc2[e]);
    if (acc2[e]) wg2[e].addmm_(gr.t(), ge); else at::mm_out(wg2[e], gr.t(), ge);
    if (r1 > r0) {
      Tensor sbe = sb.slice(0, r0, r1), sae = sa.slice(0, r0, r1), he = h.slice(0, r0, r1);
      if (dprobs.has_value()) {
        Tensor dpe = dprobs->slice(0, r0, r1);
        at::linalg_vecdot_out(dpe, dge, sbe);
      }
      dge.mul_(probs.slice(0, r0, r1).unsqueeze(-1));
      Tensor dhb = dhe.slice(1, f, 2 * f), dha = dhe.slice(1, 0, f);
      at::mul_out(dhb, dge, sae);
      at::silu_backward_out(dha, dge.mul_(he.slice(1, f, 2 * f)), he.slice(1, 0, f));
      Tensor dxe = dx.slice(0, r0, r1);
      at::mm_out(dxe, dhe, fc1[e]);
    }
    if (acc1[e]) wg1[e].addmm_(dhe.t(), xe); else at::mm_out(wg1[e], dhe.t(), xe);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "experts' SwiGLU MLPs, whole experts per thread (forward)");
  m.def("backward", &backward, "experts' SwiGLU MLPs, whole experts per thread (backward)");
}
