// `param_views`: a flat buffer's pieces shaped as the parameters they hold, made in one call.
//
// The runtime installs these views on the modules before every forward of a unit. One
// split_with_sizes makes every piece (its backward writes all gradients into one flat tensor),
// then each parameter's piece is viewed in the parameter's shape. Written in Python that is one
// call per parameter per step; here it is one per flat group, whatever the parameters in it.
// CompositeImplicitAutograd: autograd records the split and the views as if called one by one.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

namespace {

// `split_sizes` alternates a parameter's length and the padding after it, so the parameters
// are the even pieces. `ndims[i]` is parameter i's number of dimensions and `dims` all their
// sizes, one after the other. Returns the first piece of the split itself (whose autograd node
// is the split's), then each parameter's view.
std::vector<at::Tensor> param_views(const at::Tensor& flat, at::IntArrayRef split_sizes, at::IntArrayRef ndims,
                                    at::IntArrayRef dims) {
  TORCH_CHECK(split_sizes.size() == 2 * ndims.size(), "param_views: ", split_sizes.size(),
              " split sizes for ", ndims.size(), " parameters (two each expected)");
  std::vector<at::Tensor> pieces = flat.split_with_sizes(split_sizes);
  std::vector<at::Tensor> out;
  out.reserve(ndims.size() + 1);
  out.push_back(pieces[0]);
  size_t first = 0;
  for (size_t i = 0; i < ndims.size(); ++i) {
    const auto count = static_cast<size_t>(ndims[i]);
    TORCH_CHECK(first + count <= dims.size(), "param_views: parameter ", i, " has dimensions past the end");
    out.push_back(pieces[2 * i].view(dims.slice(first, count)));
    first += count;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(overlap, m) {
  m.def("param_views(Tensor(a -> *) flat, int[] split_sizes, int[] ndims, int[] dims) -> Tensor(a)[]");
}

TORCH_LIBRARY_IMPL(overlap, CompositeImplicitAutograd, m) {
  m.impl("param_views", &param_views);
}
