// The per-pass work of GradientScaling's PyTorch adapter that is PyTorch's
// own machinery rather than the method: reading a graph's structure, putting
// callbacks on its nodes and taking them off, and the landing hook every
// parameter carries for the hook's life. Python does these one Python call
// at a time (a RemovableHandle per callback, a tuple per next_functions, a
// Python call per gradient landed even when nothing is to be done); here
// they are one call each. What the callbacks do stays in Python
// (gradient_scaling/torch/backward_rules.py), but for a planned cached
// pass's: its factors, which the Python callbacks decided before the pass
// (gradient_scaling/torch/planned_pass.py), are multiplied here
// (PlannedTable, HookSet.add_planned). The small tensors GS adds
// operations on (a cast's max|g|, a factor's product, a landing's
// division) are read and multiplied by loops where that gives ATen's bits
// (loop_ready), and a refresh's reads of a tensor are one call each
// (finite_witness, small_spread_and_max, log_moments): ATen's operations,
// but a small CPU tensor's spread, whose sums loops make in lanes, and
// log_moments's selections, skipped where a loop finds they select every
// value.
// gradient_scaling/torch/native.py
// builds this file once per PyTorch version and falls back to the Python
// implementation where it cannot (passes are then not planned).

#include <torch/extension.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_hook.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <functional>
#include <atomic>
#include <tuple>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <typeinfo>
#include <map>
#include <memory>
#include <optional>
#include <unordered_set>
#include <utility>
#include <vector>

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace {

// A strong reference to a Python object that may be dropped on a thread
// without the GIL (the engine frees a graph's nodes, and their hooks, where
// it runs); leaked when the interpreter is already gone, as PyTorch's own
// Python hooks do.
struct PyRef {
  PyObject* obj;
  explicit PyRef(PyObject* o) : obj(o) { Py_XINCREF(obj); }
  PyRef(const PyRef&) = delete;
  PyRef& operator=(const PyRef&) = delete;
  ~PyRef() {
    if (obj != nullptr && Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      Py_DECREF(obj);
    }
  }
};

// A map from (non-null) pointers to values by open addressing: linear
// probing in a power-of-two table at most half full, the slot from a
// multiplicative hash: no allocation per entry, no division per lookup
// (a std::unordered_map's, in the structure read's entry per node and
// lookup per edge, cost a fifth of the read). Never shrinks, nor forgets
// an entry.
template <typename V>
class PointerTable {
 public:
  PointerTable() { rehash(16); }

  size_t size() const { return count_; }

  // Room for ``n`` entries without growing.
  void reserve(size_t n) {
    size_t capacity = keys_.size();
    while (capacity < 2 * n) capacity *= 2;
    if (capacity != keys_.size()) rehash(capacity);
  }

  // The value of ``key``, ``value`` inserted where it has none; whether
  // it was inserted.
  std::pair<V*, bool> emplace(const void* key, const V& value) {
    if (2 * (count_ + 1) > keys_.size()) rehash(2 * keys_.size());
    size_t i = slot(key);
    if (keys_[i] == key) return {&values_[i], false};
    keys_[i] = key;
    values_[i] = value;
    ++count_;
    return {&values_[i], true};
  }

  // The value of ``key``, or null.
  const V* find(const void* key) const {
    size_t i = slot(key);
    return keys_[i] == key ? &values_[i] : nullptr;
  }

 private:
  size_t slot(const void* key) const {
    size_t mask = keys_.size() - 1;
    size_t i = static_cast<size_t>(
        (reinterpret_cast<uintptr_t>(key) * 0x9E3779B97F4A7C15ull) >> shift_);
    while (keys_[i] != nullptr && keys_[i] != key) i = (i + 1) & mask;
    return i;
  }

  void rehash(size_t capacity) {
    std::vector<const void*> keys(capacity, nullptr);
    std::vector<V> values(capacity);
    keys.swap(keys_);
    values.swap(values_);
    shift_ = 64;
    for (size_t c = capacity; c > 1; c >>= 1) --shift_;
    for (size_t j = 0; j < keys.size(); ++j) {
      if (keys[j] != nullptr) {
        size_t i = slot(keys[j]);
        keys_[i] = keys[j];
        values_[i] = std::move(values[j]);
      }
    }
  }

  std::vector<const void*> keys_;
  std::vector<V> values_;
  size_t count_ = 0;
  int shift_ = 60;
};

c10::intrusive_ptr<Node> node_of(PyObject* obj) {
  c10::intrusive_ptr<Node> node;
  if (torch::autograd::THPCppFunction_Check(obj)) {
    node = reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata;
  } else if (THPFunction_Check(obj)) {
    node = reinterpret_cast<THPFunction*>(obj)->cdata;
  } else {
    throw py::type_error("gradient_scaling native: not a backward node: " +
                         std::string(Py_TYPE(obj)->tp_name));
  }
  if (!node) {
    throw py::value_error("gradient_scaling native: a backward node "
                          "without its node (freed)");
  }
  return node;
}

// A tuple of the gradients (None where undefined), as Python hooks get it.
PyObject* wrap(const variable_list& values) {
  PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
  if (tuple == nullptr) throw python_error();
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* v;
    if (values[i].defined()) {
      v = THPVariable_Wrap(values[i]);
      if (v == nullptr) {
        Py_DECREF(tuple);
        throw python_error();
      }
    } else {
      Py_INCREF(Py_None);
      v = Py_None;
    }
    PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), v);
  }
  return tuple;
}

// A hook's result: None keeps ``values``; otherwise a tuple or list of as
// many tensors or Nones.
variable_list unwrap(PyObject* result, const variable_list& values,
                     const char* what) {
  if (result == Py_None) return values;
  if (!PyTuple_Check(result) && !PyList_Check(result)) {
    PyErr_Format(PyExc_TypeError,
                 "gradient_scaling native: a %s returned %s, not a tuple",
                 what, Py_TYPE(result)->tp_name);
    throw python_error();
  }
  PyObject* seq = PySequence_Fast(result, "");
  if (seq == nullptr) throw python_error();
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (static_cast<size_t>(n) != values.size()) {
    Py_DECREF(seq);
    PyErr_Format(PyExc_RuntimeError,
                 "gradient_scaling native: a %s returned %zd values, "
                 "expected %zu", what, n, values.size());
    throw python_error();
  }
  variable_list out(values.size());
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = PySequence_Fast_GET_ITEM(seq, i);
    if (v == Py_None) continue;
    if (!THPVariable_Check(v)) {
      Py_DECREF(seq);
      PyErr_Format(PyExc_TypeError,
                   "gradient_scaling native: a %s returned a %s, not a "
                   "tensor", what, Py_TYPE(v)->tp_name);
      throw python_error();
    }
    out[i] = THPVariable_Unpack(v);
  }
  Py_DECREF(seq);
  return out;
}

// unwrap(result, ...), the reference to ``result`` dropped either way.
variable_list taken(PyObject* result, const variable_list& values,
                    const char* what) {
  try {
    variable_list out = unwrap(result, values, what);
    Py_DECREF(result);
    return out;
  } catch (...) {
    Py_DECREF(result);
    throw;
  }
}

PyObject* call(PyObject* fn, PyObject* a, PyObject* b = nullptr) {
  PyObject* result = b == nullptr ? PyObject_CallOneArg(fn, a)
                                  : PyObject_CallFunctionObjArgs(fn, a, b,
                                                                 nullptr);
  if (result == nullptr) throw python_error();
  return result;
}

// ``fn(seq, values)`` (``fn(seq, values, second)``: a post-hook's), a
// hook's Python callback, its result for ``values``.
variable_list dispatch_to(PyObject* fn, int64_t seq,
                          const variable_list& values, const char* what,
                          const variable_list* second = nullptr) {
  py::gil_scoped_acquire gil;
  py::object a = py::reinterpret_steal<py::object>(wrap(values));
  py::object b = second == nullptr
      ? py::object()
      : py::reinterpret_steal<py::object>(wrap(*second));
  PyObject* result = PyObject_CallFunctionObjArgs(
      fn, py::int_(seq).ptr(), a.ptr(),
      second == nullptr ? nullptr : b.ptr(), nullptr);
  if (result == nullptr) throw python_error();
  return taken(result, values, what);
}

// fn(grad_outputs) -> None or new grad_outputs (Node.register_prehook's).
struct PreHook : torch::autograd::FunctionPreHook {
  std::shared_ptr<PyRef> fn;
  explicit PreHook(std::shared_ptr<PyRef> f) : fn(std::move(f)) {}
  variable_list operator()(const variable_list& grads) override {
    py::gil_scoped_acquire gil;
    PyObject* args = wrap(grads);
    PyObject* result = nullptr;
    try {
      result = call(fn->obj, args);
    } catch (...) {
      Py_DECREF(args);
      throw;
    }
    Py_DECREF(args);
    return taken(result, grads, "backward pre-hook");
  }
};

// fn(grad_inputs, grad_outputs) -> None or new grad_inputs
// (Node.register_hook's).
struct PostHook : torch::autograd::FunctionPostHook {
  std::shared_ptr<PyRef> fn;
  explicit PostHook(std::shared_ptr<PyRef> f) : fn(std::move(f)) {}
  variable_list operator()(const variable_list& outputs,
                           const variable_list& inputs) override {
    py::gil_scoped_acquire gil;
    PyObject* a = wrap(outputs);
    PyObject* b = nullptr;
    PyObject* result = nullptr;
    try {
      b = wrap(inputs);
      result = call(fn->obj, a, b);
    } catch (...) {
      Py_DECREF(a);
      Py_XDECREF(b);
      throw;
    }
    Py_DECREF(a);
    Py_DECREF(b);
    return taken(result, outputs, "backward hook");
  }
};

// Elements a loop here reads or writes, single-threaded; beyond, ATen's
// kernels.
constexpr int64_t kSmallLoop = 1 << 16;

// Whether ``x``'s strides are the row-major ones of its sizes, every
// dimension's (``is_contiguous`` ignores those of size 1, where ATen's
// product of such a tensor may keep other strides than a row-major one).
bool standard_strides(const at::Tensor& x) {
  int64_t expected = 1;
  for (int64_t d = x.dim() - 1; d >= 0; --d) {
    if (x.stride(d) != expected) return false;
    expected *= x.size(d);
  }
  return true;
}

// Whether ``x`` is a plain tensor: no Python subclass or functional
// wrapper dispatching its operations elsewhere.
bool plain_tensor(const at::Tensor& x) {
  c10::DispatchKeySet keys = x.key_set();
  return !keys.has(c10::DispatchKey::Python) &&
         !keys.has(c10::DispatchKey::Functionalize) &&
         typeid(*x.unsafeGetTensorImpl()) == typeid(c10::TensorImpl);
}

// Whether ``x`` is a small dense float32 or float64 CPU tensor, a plain
// one (not a subclass's, nor a wrapper's), in row-major order, with no
// dispatch mode on (which would see ATen's operations): its values read
// by loops here (a parameter's too).
bool loop_readable(const at::Tensor& x) {
  auto dtype = x.scalar_type();
  if ((dtype != at::kFloat && dtype != at::kDouble) ||
      !x.device().is_cpu() || x.layout() != at::kStrided ||
      x.numel() > kSmallLoop || x.is_neg() || !x.has_storage() ||
      !standard_strides(x) || c10::impl::dispatch_mode_enabled()) {
    return false;
  }
  return plain_tensor(x);
}

// ... and outside autograd: read and multiplied by loops here. Their
// operations are IEEE's (a maximum, a product by a power of two), so the
// bits are those ATen's kernels give; what they save is the dispatch and
// the intermediate tensors.
bool loop_ready(const at::Tensor& x) {
  return !x.requires_grad() && loop_readable(x);
}

// GCC at -O2 leaves a loop whose length is known only when it runs
// unvectorized; these few (each value on its own: a product, a bit test,
// no sum to reorder) are worth its vector units. (Clang vectorizes them at
// -O2.)
#if defined(__GNUC__) && !defined(__clang__)
#define GS_VECTORIZED __attribute__((optimize("tree-vectorize")))
#else
#define GS_VECTORIZED
#endif

// Whether every element of ``n`` float32 or float64 values is finite (the
// exponent not all ones), read without a branch per element.
template <typename Bits>
GS_VECTORIZED bool finite_values(const void* data, int64_t n, Bits exponent) {
  const Bits* bits = static_cast<const Bits*>(data);
  Bits all_ones = 0;
  for (int64_t i = 0; i < n; ++i) {
    all_ones |= static_cast<Bits>((bits[i] & exponent) == exponent);
  }
  return all_ones == 0;
}

// Whether every element of loop_ready tensor ``x`` is finite: a yes or
// no, read where the values are (no copy, nothing written).
bool finite_loop(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat
      ? finite_values<uint32_t>(x.data_ptr(), x.numel(), 0x7f800000u)
      : finite_values<uint64_t>(x.data_ptr(), x.numel(),
                                0x7ff0000000000000ull);
}

// ``max|x|`` of a loop_ready tensor (NaN where one element is; 0 when
// empty), as ``x.abs().max()`` gives it.
template <typename T>
double max_abs_loop(const T* v, int64_t n) {
  T largest = 0;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    T a = std::abs(v[i]);
    nan |= (a != a);
    largest = a > largest ? a : largest;
  }
  return nan ? std::numeric_limits<double>::quiet_NaN()
             : static_cast<double>(largest);
}

// max_abs_loop of float32 values by their bits: |x|'s bits order as its
// values do (NaN's above infinity's), and an integer maximum vectorizes.
GS_VECTORIZED double max_abs_float(const float* v, int64_t n) {
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(v);
  uint32_t largest = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t a = bits[i] & 0x7fffffffu;
    largest = a > largest ? a : largest;
  }
  if (largest > 0x7f800000u) return std::numeric_limits<double>::quiet_NaN();
  float value;
  std::memcpy(&value, &largest, sizeof value);
  return value;
}

double max_abs(const at::Tensor& x) {
  if (x.numel() == 0) return 0.0;
  if (loop_ready(x)) {
    return x.scalar_type() == at::kFloat
        ? max_abs_loop(x.data_ptr<float>(), x.numel())
        : max_abs_loop(x.data_ptr<double>(), x.numel());
  }
  return x.abs().max().item<double>();
}

// ``x * factor`` (a power of two, a normal float32 number) into a new
// tensor, for a loop_ready ``x``: each product an IEEE one in x's dtype
// (the factor exact in it), as at::mul makes it.
template <typename T>
at::Tensor times_loop(const at::Tensor& x, double factor) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  const T* in = x.data_ptr<T>();
  T* result = out.data_ptr<T>();
  const T f = static_cast<T>(factor);
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) result[i] = in[i] * f;
  return out;
}

at::Tensor times_normal(const at::Tensor& x, double factor) {
  if (loop_ready(x)) {
    return x.scalar_type() == at::kFloat ? times_loop<float>(x, factor)
                                         : times_loop<double>(x, factor);
  }
  return x * factor;
}

// The gradients at ``indices`` times ``factor``, always a multiplication
// (a new tensor, as a site's scaling makes): among a node's incoming
// gradients (pre) or those it returns (post). No Python: what a native
// cached pass's sites would cost (the benchmark's floor control).
variable_list times(const variable_list& grads, double factor,
                    const std::vector<int64_t>& indices) {
  variable_list out(grads);
  for (int64_t i : indices) {
    if (i >= 0 && static_cast<size_t>(i) < out.size() &&
        out[i].defined()) {
      out[i] = out[i] * factor;
    }
  }
  return out;
}

struct ScalingPreHook : torch::autograd::FunctionPreHook {
  double factor;
  std::vector<int64_t> indices;
  ScalingPreHook(double f, std::vector<int64_t> i)
      : factor(f), indices(std::move(i)) {}
  variable_list operator()(const variable_list& grads) override {
    return times(grads, factor, indices);
  }
};

struct ScalingPostHook : torch::autograd::FunctionPostHook {
  double factor;
  std::vector<int64_t> indices;
  ScalingPostHook(double f, std::vector<int64_t> i)
      : factor(f), indices(std::move(i)) {}
  variable_list operator()(const variable_list& outputs,
                           const variable_list& /*inputs*/) override {
    return times(outputs, factor, indices);
  }
};

// ``x * ratio`` for a power of two ``ratio``, multiplied in the steps of
// gradient_scaling.torch.arrays.normal_steps (each a normal float32 power
// of two, the first as large as it can be), as the Python callbacks do:
// the same bits.
at::Tensor times_power_of_two(const at::Tensor& x, double ratio) {
  int exponent = 0;
  std::frexp(ratio, &exponent);
  exponent -= 1;
  at::Tensor result = x;
  while (exponent != 0) {
    int step = std::max(-126, std::min(127, exponent));
    result = times_normal(result, std::ldexp(1.0, step));
    exponent -= step;
  }
  return result;
}

// ``inverse`` as a one-element float32 tensor on ``device`` (what
// GradScaler's kernel multiplies by), made once (as the hook's
// _inverse_on makes it).
const at::Tensor& inverse_on(double inverse, at::Device device) {
  // (never destroyed: a device's tensors outlive its context otherwise)
  static auto* made =
      new std::map<std::tuple<double, int, int>, at::Tensor>();
  auto key = std::make_tuple(inverse, static_cast<int>(device.type()),
                             static_cast<int>(device.index()));
  auto found = made->find(key);
  if (found == made->end()) {
    found = made->emplace(key, at::full({1}, inverse,
                                        at::TensorOptions()
                                            .dtype(at::kFloat)
                                            .device(device))).first;
  }
  return found->second;
}

// GradScaler's kernel on one loop_ready float32 tensor: whether its values
// are all finite (read before the product), each multiplied in place by
// ``inverse`` (not where it is 1, as the kernel leaves them).
GS_VECTORIZED bool divide_loop(at::Tensor& x, float inverse) {
  float* v = x.data_ptr<float>();
  int64_t n = x.numel();
  if (inverse == 1.0f) return finite_values<uint32_t>(v, n, 0x7f800000u);
  uint32_t all_ones = 0;
  for (int64_t i = 0; i < n; ++i) {  // (one read of each value)
    uint32_t bits;
    std::memcpy(&bits, v + i, sizeof bits);
    all_ones |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
    v[i] = v[i] * inverse;
  }
  return all_ones == 0;
}

// The float32 gradients left scaled in ``.grad`` (``pairs``: ``(param,
// inverse)`` each, in the order they landed) divided in place as
// GradScaler.unscale_ divides them: by its fused kernel, those of one
// device and inverse at once (the small dense CPU ones by divide_loop, its
// bits), checked in the same read into the pass's
// flag for their device (``flags``: device -> a one-element tensor, made
// there where missing); one whose storage an earlier one's shares (the
// engine made the two ``.grad`` views of one gradient) into a new tensor,
// read before that one is divided. Returns ``(divided, rest)``: the
// parameters divided so, and the pairs whose gradient is not
// float32 and dense (for the caller, with the storages it may share among
// them). gradient_scaling.torch.hook's _unscale_pending is its Python twin.
py::tuple divide_left_scaled(py::iterable pairs, py::dict flags) {
  struct Group {
    at::Device device;
    double inverse;
    std::vector<at::Tensor> grads;
    py::list params;
  };
  std::vector<Group> groups;
  PointerTable<char> storages;
  py::list rest;
  for (py::handle item : pairs) {
    auto pair = py::reinterpret_borrow<py::tuple>(item);
    PyObject* param = pair[0].ptr();
    double inverse = pair[1].cast<double>();
    const at::Tensor& variable = THPVariable_Unpack(param);
    at::Tensor grad = variable.grad();
    if (!grad.defined()) continue;
    if (grad.scalar_type() != at::kFloat || grad.layout() != at::kStrided) {
      rest.append(pair);
      continue;
    }
    if (!storages.emplace(grad.storage().data(), 1).second) {
      at::Tensor divided = times_power_of_two(grad, inverse);
      THPVariable_Unpack(param).mutable_grad() = divided;
      continue;
    }
    Group* group = nullptr;
    for (auto& g : groups) {
      if (g.device == grad.device() && g.inverse == inverse) {
        group = &g;
        break;
      }
    }
    if (group == nullptr) {
      groups.push_back({grad.device(), inverse, {}, py::list()});
      group = &groups.back();
    }
    group->grads.push_back(grad);
    group->params.append(pair[0]);
  }
  py::list divided;
  for (auto& g : groups) {
    py::object device = py::cast(g.device);
    PyObject* known = PyDict_GetItemWithError(flags.ptr(), device.ptr());
    if (known == nullptr && PyErr_Occurred()) throw python_error();
    at::Tensor found;
    if (known != nullptr) {
      if (!THPVariable_Check(known)) {
        throw py::type_error("gradient_scaling native: a pass's flag that "
                             "is not a tensor");
      }
      found = THPVariable_Unpack(known);
    } else {
      found = at::zeros({1}, at::TensorOptions().dtype(at::kFloat)
                                 .device(g.device));
      flags[device] = py::reinterpret_steal<py::object>(
          THPVariable_Wrap(found));
    }
    // The small dense CPU ones by a loop (the kernel's check of each
    // value, then its one product in float32), the others by the kernel.
    std::vector<at::Tensor> others;
    bool finite = true;
    for (auto& grad : g.grads) {
      if (loop_ready(grad)) {
        finite = divide_loop(grad, static_cast<float>(g.inverse)) && finite;
      } else {
        others.push_back(grad);
      }
    }
    if (!finite) found.fill_(1.0);
    if (!others.empty()) {
      at::_amp_foreach_non_finite_check_and_unscale_(
          others, found, inverse_on(g.inverse, g.device));
    }
    for (py::handle p : g.params) divided.append(p);
  }
  return py::make_tuple(divided, rest);
}

// The factors of a planned cached pass (gradient_scaling/torch/
// planned_pass.py), shared by its hooks: set as the pass starts (mode 1);
// or, where the plan could not be made for what its cast sites chose,
// every hook hands its gradients to ``dispatch`` (mode 2, the Python
// callbacks); before either (mode 0) a hook refuses to run. ``checks``: for
// each hook that is a cast site (by its place in the planned order), the
// ``[low, high)`` its ``fmt_max / max|g|`` (of its incoming gradient) must
// be in for the scale planned; where it is not, ``bound(seq, max|g|)`` is
// told first (it plans the pass again, or hands it to Python).
struct Planned {
  std::vector<double> factors;
  std::vector<std::pair<double, double>> checks;
  double fmt_max = 0.0;
  int mode = 0;
  int64_t next = 0;  // the sequence number after the last hook's
  bool deviated = false;  // a hook ran out of the planned order
  // Per sequence number, whether a hook of it is on the graph (a pass
  // puts hooks only where they multiply or check, and more where it is
  // planned again or handed to Python): the order checked is theirs.
  std::vector<char> hooked;
  std::shared_ptr<PyRef> dispatch;
  std::shared_ptr<PyRef> bound;
};

class PlannedTable {
 public:
  PlannedTable() : state(std::make_shared<Planned>()) {}

  // The pass's factors and cast checks (as it starts, or planned again
  // while it runs: the order checked goes on).
  void set(std::vector<double> factors,
           std::vector<std::pair<double, double>> checks) {
    state->factors = std::move(factors);
    state->checks = std::move(checks);
    state->mode = 1;
  }

  // Where a cast's cap binds (the format's largest value ``fmt_max``).
  void checked_by(py::handle bound, double fmt_max) {
    state->bound = std::make_shared<PyRef>(bound.ptr());
    state->fmt_max = fmt_max;
  }

  void use_python(py::handle dispatch) {
    state->dispatch = std::make_shared<PyRef>(dispatch.ptr());
    state->mode = 2;
  }

  int mode() const { return state->mode; }
  bool deviated() const { return state->deviated; }

  std::shared_ptr<Planned> state;
};

// Whether the cast site of hook ``seq`` chooses another scale than
// planned (gradient_scaling.core.rules.cached_cast_scale: the cached scale,
// capped by the power of two at most ``fmt_max / max|g|`` where
// ``0 < max|g| < inf``): ``largest`` set to its ``max|g|``.
bool deviates(const Planned& table, int64_t seq, const variable_list& grads,
              double* largest) {
  if (seq < 0 || static_cast<size_t>(seq) >= table.checks.size()) {
    return false;
  }
  const auto& range = table.checks[static_cast<size_t>(seq)];
  const double inf = std::numeric_limits<double>::infinity();
  if (range.first <= 0 || grads.empty() || !grads[0].defined()) return false;
  *largest = max_abs(grads[0]);
  if (!(*largest > 0 && *largest < inf)) return range.second < inf;
  double quotient = table.fmt_max / *largest;
  return quotient < range.first ||
         (range.second < inf && quotient >= range.second);
}

// A hook of sequence number ``seq`` is on the graph.
void mark_hooked(Planned& table, int64_t seq) {
  if (seq < 0) throw py::value_error("gradient_scaling native: seq < 0");
  if (static_cast<size_t>(seq) >= table.hooked.size()) {
    table.hooked.resize(static_cast<size_t>(seq) + 1, 0);
  }
  table.hooked[static_cast<size_t>(seq)] = 1;
}

// The planned factors applied to ``grads``: gradient ``index`` times
// factor ``slot`` for each ``(index, slot)``; checks the hook's place in
// the planned order (the next of those on the graph).
variable_list planned_times(Planned& table, int64_t seq,
                            const std::vector<std::pair<int64_t, int64_t>>&
                                slots,
                            const variable_list& grads) {
  if (table.mode != 1) {
    throw std::runtime_error(
        "GradientScaling: a planned backward pass reached a node before "
        "it started (the engine ran the graph's nodes in another order "
        "than the pass recorded; GRADIENT_SCALING_NATIVE=0 avoids planned "
        "passes)");
  }
  int64_t expected = table.next;
  int64_t size = static_cast<int64_t>(table.hooked.size());
  while (expected < size && !table.hooked[expected]) ++expected;
  if (seq != expected) table.deviated = true;
  table.next = seq + 1;
  variable_list out(grads);
  for (const auto& entry : slots) {
    auto i = static_cast<size_t>(entry.first);
    double factor = table.factors.at(static_cast<size_t>(entry.second));
    if (i < out.size() && out[i].defined() && factor != 1.0) {
      out[i] = times_power_of_two(out[i], factor);
    }
  }
  return out;
}

// What a planned pass's hook holds: the table, its place in the planned
// order, the (gradient index, factor slot) pairs it multiplies; in mode
// 2, ``dispatch(seq, *args)`` instead (the Python callback's result for
// ``values``).
struct PlannedHook {
  std::shared_ptr<Planned> table;
  int64_t seq;
  std::vector<std::pair<int64_t, int64_t>> slots;
  PlannedHook(std::shared_ptr<Planned> t, int64_t s,
              std::vector<std::pair<int64_t, int64_t>> i)
      : table(std::move(t)), seq(s), slots(std::move(i)) {}

  variable_list apply(const variable_list& values, const char* what,
                      const variable_list* second = nullptr) {
    double largest = 0;
    if (table->mode == 1 && table->bound &&
        deviates(*table, seq, values, &largest)) {
      py::gil_scoped_acquire gil;
      PyObject* told = PyObject_CallFunction(
          table->bound->obj, "Ld", static_cast<long long>(seq), largest);
      if (told == nullptr) throw python_error();
      Py_DECREF(told);
    }
    if (table->mode != 2) return planned_times(*table, seq, slots, values);
    return dispatch_to(table->dispatch->obj, seq, values, what, second);
  }
};

struct PlannedPreHook : torch::autograd::FunctionPreHook, PlannedHook {
  using PlannedHook::PlannedHook;
  variable_list operator()(const variable_list& grads) override {
    return apply(grads, "backward pre-hook");
  }
};

struct PlannedPostHook : torch::autograd::FunctionPostHook, PlannedHook {
  using PlannedHook::PlannedHook;
  variable_list operator()(const variable_list& outputs,
                           const variable_list& inputs) override {
    return apply(outputs, "backward hook", &inputs);
  }
};

// A planned pass's native hooks, as a layout lays them out (made once per
// layout): each on the node at ``position`` of the graph's structure
// order, a post-hook or a pre-hook, its place in the planned order, its
// (gradient index, factor slot) pairs.
struct PlannedEvent {
  Py_ssize_t position;
  bool post;
  int64_t seq;
  std::vector<std::pair<int64_t, int64_t>> slots;
};

struct PlannedEvents {
  std::vector<PlannedEvent> events;
};

PlannedEvents planned_events(
    std::vector<std::tuple<Py_ssize_t, bool, int64_t,
                           std::vector<std::pair<int64_t, int64_t>>>>
        events) {
  PlannedEvents out;
  for (auto& e : events) {
    out.events.push_back({std::get<0>(e), std::get<1>(e), std::get<2>(e),
                          std::move(std::get<3>(e))});
  }
  return out;
}

// A refresh's reads, defined below (TorchOps's statistics).
std::optional<std::tuple<double, double, double, double, double>>
gemm_model_scale(const at::Tensor& grad, const at::Tensor& weight,
                 int64_t n, double coefficient, double fmt_max,
                 int64_t limit);
std::tuple<int64_t, double, double, double, double, int64_t, double, double>
log_moments(const at::Tensor& given);
double pow2_ceil(double x);
double pow2_floor(double x);
at::Tensor saved_witness(const c10::intrusive_ptr<Node>& node,
                         const std::string& field);

// The benchmark's control of a refresh's reads: at a GEMM site, the reads
// a GS refresh makes of its incoming gradient and weight and Theorem 1's
// capped scale (gemm_model_scale), or, where those are not tensors it
// reads (Python reads them in a GS refresh too), ``fallback(grad)``'s; at
// a cast site (no weight), its log-normal read (log_moments); then the
// gradient times 1, as the scaling control's hook. Each read's result
// (the GEMM's scale, the cast's mean of log |g|) appended to ``out``: no
// other Python, what a refresh whose work were native would cost.
struct RefreshReadHook : torch::autograd::FunctionPreHook {
  at::Tensor weight;  // (undefined: a cast site)
  int64_t n;
  double coefficient, fmt_max;
  int64_t limit;
  std::shared_ptr<PyRef> fallback;
  std::shared_ptr<std::vector<double>> out;
  RefreshReadHook(at::Tensor w, int64_t n_, double c, double m, int64_t l,
                  std::shared_ptr<PyRef> f,
                  std::shared_ptr<std::vector<double>> o)
      : weight(std::move(w)), n(n_), coefficient(c), fmt_max(m), limit(l),
        fallback(std::move(f)), out(std::move(o)) {}
  variable_list operator()(const variable_list& grads) override {
    if (grads.empty() || !grads[0].defined()) return grads;
    if (!weight.defined()) {
      out->push_back(std::get<6>(log_moments(grads[0])));
    } else if (auto read = gemm_model_scale(grads[0], weight, n,
                                            coefficient, fmt_max, limit)) {
      out->push_back(std::get<0>(*read));
    } else {
      py::gil_scoped_acquire gil;
      py::object g = py::reinterpret_steal<py::object>(
          THPVariable_Wrap(grads[0]));
      PyObject* beta =
          PyObject_CallFunctionObjArgs(fallback->obj, g.ptr(), nullptr);
      if (beta == nullptr) throw python_error();
      const double value = PyFloat_AsDouble(beta);
      Py_DECREF(beta);
      if (value == -1.0 && PyErr_Occurred()) throw python_error();
      out->push_back(value);
    }
    return times(grads, 1.0, {0});
  }
};

// A refresh speculated (gradient_scaling/torch/speculation.py): its GEMM
// sites' hooks read their incoming gradient and weight as the refresh
// reads them (gemm_model_scale: the same call and numbers) and check that
// the scale found is the one ``expected`` (the last refresh's there, the
// scales above the site confirmed the same); where it is, the gradient is
// multiplied by the ``factor`` expected (the same product as the Python
// callback's) and the read kept for the records Python makes from it;
// where it is not (another scale, or no native read: ``readable`` False)
// or once the pass is Python's (mode 2), ``missed(seq, readable)`` is
// told first, once (it turns the pass over to Python), and
// ``dispatch(seq, grads)`` runs the site's Python callback.
// A branch's contributions on a speculated refresh, held by its
// consumers' hooks (the engine sums none of them): ``expected`` arrivals,
// the contributions that came with their scales, the common scale the
// last is to find (SpeculativeBranchHook).
struct Held {
  int64_t expected = 0, arrived = 0;
  double common = 0;
  std::vector<std::pair<at::Tensor, double>> items;
};

struct Speculated {
  int mode = 1;
  // Each read kept, in order: (seq, 0, std(g), max|g|, std(W), max|W|, n,
  // the finiteness witness of the GEMM's saved input: undefined where not
  // read) of a GEMM's, (seq, 1, mean of log|g|, their std, max|g|,
  // non-zero count, 0, undefined) of a cast's, (seq, 2, common scale, 0,
  // 0, 0, k, undefined) of a branch whose contributions' scales differ
  // (``scales[k]`` theirs, in arrival order).
  std::vector<std::tuple<int64_t, int, double, double, double, double,
                         int64_t, at::Tensor>>
      kept;
  std::vector<std::vector<double>> scales;
  std::vector<Held> branches;
  double sum_max = 0;  // lambda_max of a branch's sum (its format's)
  std::shared_ptr<PyRef> missed, dispatch;

  // A hook of ``seq`` missed (what its call did undone): the pass is
  // Python's from here, ``missed`` told.
  void miss(int64_t seq, bool readable) {
    mode = 2;
    py::gil_scoped_acquire gil;
    PyObject* told = PyObject_CallFunction(
        missed->obj, "Li", static_cast<long long>(seq), readable ? 1 : 0);
    if (told == nullptr) throw python_error();
    Py_DECREF(told);
  }

  // The Python callback of the hook of ``seq`` on ``values`` (and, a
  // post-hook's, ``second``).
  variable_list dispatched(int64_t seq, const variable_list& values,
                           const char* what,
                           const variable_list* second = nullptr) {
    return dispatch_to(dispatch->obj, seq, values, what, second);
  }
};

class Speculation {
 public:
  // ``sum_max``: the largest value of the format of a branch's sum.
  Speculation(py::handle missed, py::handle dispatch, double sum_max)
      : state(std::make_shared<Speculated>()) {
    state->missed = std::make_shared<PyRef>(missed.ptr());
    state->dispatch = std::make_shared<PyRef>(dispatch.ptr());
    state->sum_max = sum_max;
  }

  // The hooks from now on run the Python callbacks (no ``missed``).
  void use_python() { state->mode = 2; }
  int mode() const { return state->mode; }

  // The reads kept so far, in order (then forgotten): a branch's with
  // its contributions' scales (a tuple) last.
  py::list take_kept() {
    py::list out;
    for (const auto& k : state->kept) {
      const at::Tensor& w = std::get<7>(k);
      py::object last = py::none();
      if (std::get<1>(k) == 2) {
        last = py::tuple(py::cast(
            state->scales.at(static_cast<size_t>(std::get<6>(k)))));
      } else if (w.defined()) {
        last = py::reinterpret_steal<py::object>(THPVariable_Wrap(w));
      }
      out.append(py::make_tuple(std::get<0>(k), std::get<1>(k),
                                std::get<2>(k), std::get<3>(k),
                                std::get<4>(k), std::get<5>(k),
                                std::get<6>(k), last));
    }
    state->kept.clear();
    state->scales.clear();
    return out;
  }

  // The branches the hooks hold (``expected`` arrivals each, the last to
  // find ``common``).
  void hold(std::vector<std::pair<int64_t, double>> branches) {
    state->branches.assign(branches.size(), Held());
    for (size_t b = 0; b < branches.size(); ++b) {
      state->branches[b].expected = branches[b].first;
      state->branches[b].common = branches[b].second;
    }
  }

  // What the branches not yet summed hold, handed over (then forgotten):
  // (branch, arrivals, [(contribution, scale), ...]) of each that had one.
  py::list take_held() {
    py::list out;
    for (size_t b = 0; b < state->branches.size(); ++b) {
      Held& held = state->branches[b];
      if (held.arrived == 0 || held.arrived >= held.expected) continue;
      py::list items;
      for (const auto& item : held.items) {
        items.append(py::make_tuple(
            py::reinterpret_steal<py::object>(THPVariable_Wrap(item.first)),
            item.second));
      }
      out.append(py::make_tuple(b, held.arrived, items));
      held.items.clear();
      held.arrived = held.expected;
    }
    return out;
  }

  std::shared_ptr<Speculated> state;
};

// The constants of estimators.py's ModelEstimator.cast (underflow.py's
// lognormal_scale_from_stats): ln(lambda_min), the target rate's ndtri
// quantile, ln(MAX_SCALE) and lambda_max, as Python computes them.
struct CastModel {
  double log_min = 0, quantile = 0, ln_max_scale = 0, fmt_max = 0;
};

// ModelEstimator.cast of a gradient whose log_moments are ``r`` (Theorem
// 2, capped: lognormal_scale_from_stats, the same operations in the same
// order): its scale, or NaN where Python would not take that path (a value
// not finite, no non-zero value: Python raises, or answers 1 at once).
double cast_model_scale(
    const std::tuple<int64_t, double, double, double, double, int64_t,
                     double, double>& r,
    const CastModel& m, double* sigma) {
  constexpr double kMinScale = 0x1p-126, kMaxScale = 0x1p126;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const double largest = std::get<4>(r), mu = std::get<6>(r),
               variance = std::get<7>(r);
  if (static_cast<double>(std::get<0>(r)) != std::get<1>(r) ||
      std::get<5>(r) == 0 || !(largest > 0 && largest < inf) ||
      !std::isfinite(mu) || !std::isfinite(variance)) {
    return nan;
  }
  *sigma = std::sqrt(std::max(variance, 0.0));  // (Python's max, as it)
  const double log_target = m.log_min - mu - *sigma * m.quantile;
  double target;
  if (log_target > m.ln_max_scale) {
    target = inf;
  } else if (log_target < -1.0) {
    target = 1.0;
  } else {
    target = std::exp(log_target);
    if (*sigma == 0) target = 2.0 * pow2_floor(target);
  }
  const double cap = m.fmt_max / largest;
  double scale = target < kMaxScale ? pow2_ceil(target > 1.0 ? target : 1.0)
                                    : kMaxScale;
  if (cap < scale) scale = cap >= kMinScale ? pow2_floor(cap) : kMinScale;
  return scale;
}

// A speculated site's hook: a cast's stage (``cast_expected`` > 0: its
// scale from the log-normal read, then its product), then a GEMM's
// (``weight`` defined: its scale from gemm_model_scale, then its
// product), each checked against the scale expected; a stage that fails
// takes back what the hook kept and hands the gradients, as they came,
// to the Python callback. A GEMM that passes keeps the finiteness witness
// of its saved input (``field``, where not empty; its node still has it:
// the pre-hook runs first), which the refresh's traces keep.
struct SpeculativeSiteHook : torch::autograd::FunctionPreHook {
  std::shared_ptr<Speculated> state;
  int64_t seq;
  c10::weak_intrusive_ptr<Node> node;
  std::string field;
  double cast_expected, cast_factor;
  CastModel cast;
  at::Tensor weight;
  // N: the incoming gradient's size on ``axis`` where it is a matrix
  // (axis >= 0), else ``n`` (< 1: not known, a miss)
  int64_t axis, n;
  double coefficient, fmt_max;
  int64_t limit;
  double expected, factor;
  SpeculativeSiteHook(std::shared_ptr<Speculated> s, int64_t q,
                      const c10::intrusive_ptr<Node>& on, std::string fd,
                      double ce, double cf, CastModel cm, at::Tensor w,
                      int64_t a, int64_t n_, double c, double m, int64_t l,
                      double e, double f)
      : state(std::move(s)), seq(q), node(on), field(std::move(fd)),
        cast_expected(ce), cast_factor(cf), cast(cm), weight(std::move(w)),
        axis(a), n(n_), coefficient(c), fmt_max(m), limit(l), expected(e),
        factor(f) {}

  // The stages on ``g``: whether each found its scale (``readable``
  // false where a read was not made natively).
  bool stages(at::Tensor& g, bool* readable) {
    if (cast_expected > 0) {
      auto r = log_moments(g);
      double sigma = 0;
      const double scale = cast_model_scale(r, cast, &sigma);
      if (scale != cast_expected) {
        *readable = scale == scale;
        return false;
      }
      state->kept.emplace_back(seq, 1, std::get<6>(r), sigma, std::get<4>(r),
                               static_cast<double>(std::get<5>(r)), 0,
                               at::Tensor());
      if (cast_factor != 1.0) g = times_power_of_two(g, cast_factor);
    }
    if (weight.defined()) {
      int64_t length = n;
      if (axis >= 0) length = g.dim() == 2 ? g.size(axis) : 0;
      auto read = gemm_model_scale(g, weight, length, coefficient, fmt_max,
                                   limit);
      if (!read || std::get<0>(*read) != expected) {
        *readable = static_cast<bool>(read);
        return false;
      }
      at::Tensor witness;
      if (!field.empty()) {
        auto on = node.lock();
        if (on) witness = saved_witness(on, field);
      }
      state->kept.emplace_back(seq, 0, std::get<1>(*read), std::get<2>(*read),
                               std::get<3>(*read), std::get<4>(*read),
                               length, std::move(witness));
      if (factor != 1.0) g = times_power_of_two(g, factor);
    }
    return true;
  }

  variable_list operator()(const variable_list& grads) override {
    if (state->mode == 1) {
      if (grads.empty() || !grads[0].defined()) return grads;
      at::Tensor g = grads[0];
      const size_t before = state->kept.size();
      bool readable = true;
      if (stages(g, &readable)) {
        variable_list out(grads);
        out[0] = g;
        return out;
      }
      state->kept.resize(before);
      state->miss(seq, readable);
    }
    return state->dispatched(seq, grads, "backward pre-hook");
  }
};

// underflow.py's unify_scales_from_max of finite ``maxima`` at positive
// ``scales`` (Algorithm 1, line 17; the same operations in the same
// order).
double unified_scale(const std::vector<double>& maxima,
                     const std::vector<double>& scales, double fmt_max) {
  constexpr double kMinScale = 0x1p-126;
  double worst = 0.0;
  for (size_t k = 0; k < maxima.size(); ++k) {
    worst = std::max(worst, maxima[k] / scales[k]);
  }
  std::vector<double> candidates(scales);
  std::sort(candidates.begin(), candidates.end(), std::greater<double>());
  candidates.erase(std::unique(candidates.begin(), candidates.end()),
                   candidates.end());
  for (double beta : candidates) {
    if (beta * worst < fmt_max) return beta;
  }
  const double bound = fmt_max / worst;
  double beta = bound > kMinScale ? pow2_floor(bound) : kMinScale;
  if (beta == bound) beta = beta > kMinScale ? beta / 2 : kMinScale;
  return beta;
}

// A speculated refresh's branch consumer (backward_rules.py's _contribute
// and _sum): each of its ``edges`` ``(input, branch, scale)`` holds the
// gradient it returns for that input, at the consumer's expected
// ``scale``, and the engine gets none; the last to arrive returns their
// sum at the common scale (each brought to it, then added, in arrival
// order), the common scale checked against the one expected (from the
// maxima, through unified_scale, where their scales differ: that read
// kept). One that misses (another scale, a maximum not finite, a last
// contribution that is None beside held ones) undoes what the call did
// and hands it to the Python callback, after ``missed``.
struct SpeculativeBranchHook : torch::autograd::FunctionPostHook {
  std::shared_ptr<Speculated> state;
  int64_t seq;
  std::vector<std::tuple<int64_t, int64_t, double>> edges;
  SpeculativeBranchHook(std::shared_ptr<Speculated> s, int64_t q,
                        std::vector<std::tuple<int64_t, int64_t, double>> e)
      : state(std::move(s)), seq(q), edges(std::move(e)) {}

  // The sum of branch ``held`` (its last contribution in), or undefined
  // where it misses (``*missed`` set).
  at::Tensor summed(Held& held, bool* missed) {
    const auto& items = held.items;
    bool same = true;
    for (const auto& item : items) same &= item.second == items[0].second;
    double common = items[0].second;
    if (!same) {
      std::vector<double> maxima, scales;
      for (const auto& item : items) {
        const double m = max_abs(item.first);
        if (!std::isfinite(m)) {
          *missed = true;
          return at::Tensor();
        }
        maxima.push_back(m);
        scales.push_back(item.second);
      }
      common = unified_scale(maxima, scales, state->sum_max);
      if (common != held.common) {
        *missed = true;
        return at::Tensor();
      }
      state->scales.push_back(std::move(scales));
      state->kept.emplace_back(
          seq, 2, common, 0.0, 0.0, 0.0,
          static_cast<int64_t>(state->scales.size()) - 1, at::Tensor());
    } else if (common != held.common) {
      *missed = true;
      return at::Tensor();
    }
    at::Tensor total;
    for (const auto& item : items) {
      at::Tensor g = item.second != common
          ? times_power_of_two(item.first, common / item.second)
          : item.first;
      total = total.defined() ? total + g : g;
    }
    return total;
  }

  variable_list operator()(const variable_list& outputs,
                           const variable_list& inputs) override {
    if (state->mode == 1) {
      variable_list out(outputs);
      const size_t kept = state->kept.size(), scales = state->scales.size();
      std::vector<std::pair<int64_t, bool>> done;  // (branch, pushed)
      std::vector<int64_t> summed_branches;
      bool missed = false;
      for (const auto& edge : edges) {
        const auto i = static_cast<size_t>(std::get<0>(edge));
        Held& held = state->branches.at(
            static_cast<size_t>(std::get<1>(edge)));
        const bool given = i < out.size() && out[i].defined();
        if (given && !(std::get<2>(edge) > 0)) {
          missed = true;  // (its scale not expected: not known)
          break;
        }
        held.arrived += 1;
        if (given) held.items.emplace_back(out[i], std::get<2>(edge));
        done.emplace_back(std::get<1>(edge), given);
        if (held.arrived < held.expected) {
          if (given) out[i] = at::Tensor();
          continue;
        }
        if (held.items.empty()) continue;  // (none: passed on as None)
        if (!given) {
          missed = true;  // (Python raises its error)
          break;
        }
        out[i] = summed(held, &missed);
        if (missed) break;
        summed_branches.push_back(std::get<1>(edge));
      }
      if (!missed) {
        for (int64_t b : summed_branches) {
          state->branches[static_cast<size_t>(b)].items.clear();
        }
        return out;
      }
      for (auto it = done.rbegin(); it != done.rend(); ++it) {
        Held& held = state->branches[static_cast<size_t>(it->first)];
        held.arrived -= 1;
        if (it->second) held.items.pop_back();
      }
      state->kept.resize(kept);
      state->scales.resize(scales);
      state->miss(seq, true);
    }
    return state->dispatched(seq, outputs, "backward hook", &inputs);
  }
};

// A speculated refresh's multi-output node (backward_rules.py's
// _unify_outputs): its incoming gradients, each at the ``scales``
// expected for its output (NaN: not known, a miss where one comes),
// brought to one scale, checked against the ``common`` expected (from
// the maxima, through unified_scale, where their scales differ: that read
// kept, as a branch's); one that misses hands them to the Python
// callback, after ``missed``.
struct SpeculativeUnifyHook : torch::autograd::FunctionPreHook {
  std::shared_ptr<Speculated> state;
  int64_t seq;
  std::vector<double> scales;
  double common;
  SpeculativeUnifyHook(std::shared_ptr<Speculated> s, int64_t q,
                       std::vector<double> e, double c)
      : state(std::move(s)), seq(q), scales(std::move(e)), common(c) {}

  variable_list operator()(const variable_list& grads) override {
    if (state->mode == 1) {
      std::vector<size_t> present;
      std::vector<double> given;
      bool missed = false;
      for (size_t k = 0; k < grads.size(); ++k) {
        if (!grads[k].defined()) continue;
        const double s = k < scales.size()
            ? scales[k] : std::numeric_limits<double>::quiet_NaN();
        if (!(s > 0)) {
          missed = true;
          break;
        }
        present.push_back(k);
        given.push_back(s);
      }
      if (!missed && present.empty()) return grads;
      bool same = !missed;
      for (double s : given) same &= s == given[0];
      if (!missed && !same) {
        std::vector<double> maxima;
        for (size_t k : present) {
          const double m = max_abs(grads[k]);
          if (!std::isfinite(m)) {
            missed = true;
            break;
          }
          maxima.push_back(m);
        }
        if (!missed) {
          missed = unified_scale(maxima, given, state->sum_max) != common;
        }
      } else if (!missed) {
        missed = given[0] != common;
      }
      if (!missed) {
        if (same) return grads;
        state->scales.push_back(given);
        state->kept.emplace_back(
            seq, 2, common, 0.0, 0.0, 0.0,
            static_cast<int64_t>(state->scales.size()) - 1, at::Tensor());
        variable_list out(grads);
        for (size_t j = 0; j < present.size(); ++j) {
          if (given[j] != common) {
            out[present[j]] = times_power_of_two(grads[present[j]],
                                                 common / given[j]);
          }
        }
        return out;
      }
      state->miss(seq, true);
    }
    return state->dispatched(seq, grads, "backward pre-hook");
  }
};

// A hook's weight: ``weight`` detached, undefined where it is None.
at::Tensor weight_of(py::handle weight) {
  if (weight.is_none()) return at::Tensor();
  if (!THPVariable_Check(weight.ptr())) {
    throw py::type_error("gradient_scaling native: a weight that is not "
                         "a tensor");
  }
  return THPVariable_Unpack(weight.ptr()).detach();
}

// The callbacks of one backward pass, taken off all at once.
class HookSet {
 public:
  ~HookSet() { clear(); }

  void add_pre(py::handle node, py::handle fn) {
    add<PreHook>(node, std::make_shared<PyRef>(fn.ptr()));
  }

  void add_post(py::handle node, py::handle fn) {
    add<PostHook>(node, std::make_shared<PyRef>(fn.ptr()));
  }

  void add_scaling_pre(py::handle node, double factor,
                       std::vector<int64_t> indices) {
    add<ScalingPreHook>(node, factor, std::move(indices));
  }

  void add_scaling_post(py::handle node, double factor,
                        std::vector<int64_t> indices) {
    add<ScalingPostHook>(node, factor, std::move(indices));
  }

  // The refresh-read control's hook on ``node`` (RefreshReadHook): a GEMM
  // site's, ``weight`` a tensor (``n``: its accumulation length), or a
  // cast site's, ``weight`` None.
  void add_refresh_read(py::handle node, py::handle weight, int64_t n,
                        double coefficient, double fmt_max, int64_t limit,
                        py::handle fallback) {
    add<RefreshReadHook>(node, weight_of(weight), n, coefficient, fmt_max,
                         limit, std::make_shared<PyRef>(fallback.ptr()),
                         reads_);
  }

  // A speculated refresh's site on ``node`` (SpeculativeSiteHook), ``seq``
  // its place among them: a cast's stage where ``cast`` is a tuple
  // (expected, factor, ln(lambda_min), quantile, ln(MAX_SCALE),
  // lambda_max), a GEMM's where ``weight`` is a tensor (its saved input's
  // ``field`` read for its witness, where not empty).
  void add_speculative(py::handle node, const Speculation& speculation,
                       int64_t seq, py::object cast, py::handle weight,
                       int64_t axis, int64_t n, double coefficient,
                       double fmt_max, int64_t limit, double expected,
                       double factor, std::string field) {
    speculate_on(node_of(node.ptr()), speculation, seq, cast, weight, axis,
                 n, coefficient, fmt_max, limit, expected, factor,
                 std::move(field));
  }

  // A speculated refresh's multi-output node on ``node``
  // (SpeculativeUnifyHook): ``scales``, its outputs' expected, ``common``
  // the scale it is to bring them to.
  void add_speculative_unify(py::handle node, const Speculation& speculation,
                             int64_t seq, std::vector<double> scales,
                             double common) {
    add<SpeculativeUnifyHook>(node, speculation.state, seq,
                              std::move(scales), common);
  }

  // A speculated refresh's branch consumers (SpeculativeBranchHook), each
  // of ``consumers`` on its node of ``order`` (a NodeOrder): ``(position,
  // seq, [(input, branch, scale), ...])``, in one call.
  void add_speculative_branches_at(
      py::handle order, const Speculation& speculation,
      std::vector<std::tuple<
          Py_ssize_t, int64_t,
          std::vector<std::tuple<int64_t, int64_t, double>>>> consumers);

  // add_speculative of each of ``events`` on its node of ``order`` (a
  // NodeOrder): ``(position, seq, cast, weight, axis, n, coefficient,
  // fmt_max, limit, expected, factor, field)``, in one call.
  void add_speculative_at(py::handle order, const Speculation& speculation,
                          py::list events);

  // What the refresh-read hooks read so far, in order (then forgotten).
  std::vector<double> take_reads() {
    std::vector<double> taken;
    taken.swap(*reads_);
    return taken;
  }

  // A planned pass's hook on ``node``: its gradients (incoming for a
  // pre-hook, returned for a post-hook) times the factors of ``table``
  // at ``slots`` (``(index, slot)`` pairs); ``seq``: its place in the
  // pass's planned order.
  void add_planned(py::handle node, const PlannedTable& table, bool post,
                   int64_t seq,
                   std::vector<std::pair<int64_t, int64_t>> slots) {
    mark_hooked(*table.state, seq);
    if (post) {
      add<PlannedPostHook>(node, table.state, seq, std::move(slots));
    } else {
      add<PlannedPreHook>(node, table.state, seq, std::move(slots));
    }
  }

  // Every hook of ``events`` on its node of ``order`` (the graph's nodes
  // in structure order: a NodeOrder, or a list of them), in one call.
  void add_planned_events(py::handle order, const PlannedTable& table,
                          const PlannedEvents& events);

  // add_speculative's hook on ``node``.
  void speculate_on(const c10::intrusive_ptr<Node>& node,
                    const Speculation& speculation, int64_t seq,
                    const py::object& cast, py::handle weight, int64_t axis,
                    int64_t n, double coefficient, double fmt_max,
                    int64_t limit, double expected, double factor,
                    std::string field) {
    double cast_expected = 0, cast_factor = 1;
    CastModel model;
    if (!cast.is_none()) {
      auto c = cast.cast<std::tuple<double, double, double, double, double,
                                    double>>();
      cast_expected = std::get<0>(c);
      cast_factor = std::get<1>(c);
      model = {std::get<2>(c), std::get<3>(c), std::get<4>(c),
               std::get<5>(c)};
      if (!(cast_expected > 0)) {
        throw py::value_error("gradient_scaling native: a cast's expected "
                              "scale that is not positive");
      }
    }
    add_on<SpeculativeSiteHook>(node, speculation.state, seq, node,
                                std::move(field), cast_expected,
                                cast_factor, model, weight_of(weight), axis,
                                n, coefficient, fmt_max, limit, expected,
                                factor);
  }

  // Takes every callback off the nodes still alive (never while the
  // engine runs one of those nodes: the adapter removes a pass's callbacks
  // before or after its backward, as PyTorch's handles require too).
  void clear() {
    for (auto& entry : entries_) {
      auto n = entry.node.lock();
      if (!n) continue;
      if (entry.pre) {
        auto& hooks = n->pre_hooks();
        for (auto it = hooks.begin(); it != hooks.end(); ++it) {
          if (it->get() == entry.key) {
            hooks.erase(it);
            break;
          }
        }
      } else {
        n->del_post_hook(reinterpret_cast<uintptr_t>(entry.key));
      }
    }
    entries_.clear();
  }

  size_t size() const { return entries_.size(); }

 private:
  // A ``Hook`` made of ``args`` on ``node``: a pre-hook or a post-hook by
  // its kind, kept to be taken off.
  template <typename Hook, typename... Args>
  void add(py::handle node, Args&&... args) {
    add_on<Hook>(node_of(node.ptr()), std::forward<Args>(args)...);
  }

  template <typename Hook, typename... Args>
  void add_on(const c10::intrusive_ptr<Node>& n, Args&&... args) {
    auto hook = std::make_unique<Hook>(std::forward<Args>(args)...);
    void* key = hook.get();
    constexpr bool pre =
        std::is_base_of_v<torch::autograd::FunctionPreHook, Hook>;
    if constexpr (pre) {
      n->add_pre_hook(std::move(hook));
    } else {
      n->add_post_hook(std::move(hook));
    }
    entries_.push_back({c10::weak_intrusive_ptr<Node>(n), key, pre});
  }

  struct Entry {
    c10::weak_intrusive_ptr<Node> node;
    void* key;
    bool pre;
  };
  std::vector<Entry> entries_;
  std::shared_ptr<std::vector<double>> reads_ =
      std::make_shared<std::vector<double>>();
};

// Parameters -> the scale their gradients carry in a pass.
using UnitSet = PointerTable<double>;

// A set of parameters with the scale each one's gradient carries
// (Landing.landing_set, or Landing.unit_set: all at 1; made once per
// plan: set_unit swaps a pointer). A refresh pass makes an empty one of
// its own and adds each parameter's scale as it learns it, before the
// gradient lands (Landing.learn).
struct Unit {
  std::shared_ptr<UnitSet> set;
};

const c10::TensorImpl* tensor_impl(PyObject* obj) {
  if (!THPVariable_Check(obj)) {
    throw py::type_error("gradient_scaling native: not a tensor");
  }
  return THPVariable_Unpack(obj).unsafeGetTensorImpl();
}

Unit unit_set(py::iterable params) {
  auto set = std::make_shared<UnitSet>();
  for (auto item : params) set->emplace(tensor_impl(item.ptr()), 1.0);
  return Unit{std::move(set)};
}

void check_landing_scale(double scale) {
  int exponent = 0;
  if (!(scale > 0.0) || std::frexp(scale, &exponent) != 0.5) {
    throw py::value_error("gradient_scaling native: a landing scale "
                          "that is no power of two");
  }
}

Unit landing_set(std::vector<std::pair<py::object, double>> pairs) {
  auto set = std::make_shared<UnitSet>();
  for (const auto& pair : pairs) {
    check_landing_scale(pair.second);
    set->emplace(tensor_impl(pair.first.ptr()), pair.second);
  }
  return Unit{std::move(set)};
}

// Each ``(param, scale)`` of ``pairs``: ``param``'s gradient lands at
// ``scale`` (a power of two) in ``unit``, added where it has none (a
// parameter's scale, once known, is kept).
void learn(Unit& unit, py::iterable pairs) {
  for (auto item : pairs) {
    auto pair = item.cast<py::tuple>();
    if (pair.size() != 2) {
      throw py::value_error("gradient_scaling native: learn takes "
                            "(param, scale) pairs");
    }
    double scale = pair[1].cast<double>();
    check_landing_scale(scale);
    unit.set->emplace(tensor_impl(pair[0].ptr()), scale);
  }
}

// ``grad / scale`` as the adapter's Python landing divides it
// (gradient_scaling.torch.hook.unscaled): a float16 or bfloat16 gradient
// in float32, then back.
at::Tensor unscaled(const at::Tensor& grad, double scale) {
  auto dtype = grad.scalar_type();
  if (dtype == at::kHalf || dtype == at::kBFloat16) {
    return times_power_of_two(grad.to(at::kFloat), 1.0 / scale).to(dtype);
  }
  return times_power_of_two(grad, 1.0 / scale);
}

// What a parameter's landing hook needs to know without Python: whether a
// pass of its GradientScaling runs, and the parameters whose gradients
// reach them at a scale known before they land (each recorded, and
// divided there).
struct LandingState {
  bool running = false;
  std::shared_ptr<const UnitSet> unit;
  PyObject* record = nullptr;  // a list: (param, scale) appended
  // A list: (param, 1 / scale) appended for a gradient left scaled in an
  // empty ``.grad`` (divided there when the pass ends); null: none is.
  PyObject* pending = nullptr;
  std::unordered_set<const c10::TensorImpl*> excluded;
  // This setting's number: a hook whose gradient was left scaled under
  // it holds it (a second would land into that .grad).
  uint64_t setting = 1;
  ~LandingState() {
    if (Py_IsInitialized()) {
      Py_XDECREF(record);
      Py_XDECREF(pending);
    }
  }
};

// The state of a GradientScaling's landing hooks, set by the adapter as
// its passes start and end.
class Landing {
 public:
  Landing() : state(std::make_shared<LandingState>()) {}

  void set_running(bool running) { state->running = running; }

  // The parameters of ``unit`` (a unit_set or a landing_set) then land at
  // their scale, each recorded in ``record`` (a list) as ``(param,
  // scale)`` and divided by it; None: none does. With ``pending`` (a
  // list), a gradient that may be left scaled in ``.grad`` is (appended
  // as ``(param, 1 / scale)``, divided there when the pass ends, as the
  // adapter's Python landing defers it): a float32 or float64 dense
  // gradient whose ``.grad`` is empty, the inverse a normal float32
  // number, grad mode off, the parameter not in ``excluded`` (those with
  // another hook that would read it).
  void set_unit(py::handle unit, py::handle record, py::handle pending,
                py::iterable excluded) {
    Py_XDECREF(state->record);
    Py_XDECREF(state->pending);
    state->record = state->pending = nullptr;
    state->unit.reset();
    state->excluded.clear();
    ++state->setting;
    if (unit.is_none()) return;
    state->unit = unit.cast<const Unit&>().set;
    Py_INCREF(record.ptr());
    state->record = record.ptr();
    if (!pending.is_none()) {
      Py_INCREF(pending.ptr());
      state->pending = pending.ptr();
    }
    for (auto item : excluded) {
      state->excluded.insert(tensor_impl(item.ptr()));
    }
  }

  std::shared_ptr<LandingState> state;
};

// What an adopted parameter's LandingPreHook and the landing hook it
// lands for share: whether the wrapper still holds PyTorch's hook of the
// parameter's Python hooks (and with it a reference to their dictionary),
// the dictionary, and the landing hook (null once it is freed). PyTorch
// tells the collector of that reference by the tensor (it visits the
// dictionary of each of its own such hooks); held in the wrapper, the
// landing hook tells it instead, while it is the one adopted, so that a
// cycle through the dictionary (a hook that holds its parameter) is
// collected as it would be.
struct Adoption {
  std::atomic<bool> holds{true};
  PyObject* dict = nullptr;
  PyObject* landing = nullptr;
  c10::weak_intrusive_ptr<c10::TensorImpl> tensor{
      c10::weak_intrusive_ptr<c10::TensorImpl>(
          c10::intrusive_ptr<c10::TensorImpl>())};  // the parameter's
};

// A parameter's landing hook (``param.register_hook(hook)``, in its
// Python hooks, where they run in order): a callable object in C, so that
// a gradient landing while no pass runs, or at scale 1, costs no Python
// frame; otherwise ``fn(grad)`` (the adapter's Python landing: None or the
// gradient divided). Adopted (adopt_landing), it lands without being
// called from Python at all while it is the parameter's only Python hook.
struct LandingHook {
  PyObject_HEAD
  std::shared_ptr<LandingState>* state;
  const c10::TensorImpl* impl;
  PyObject* fn;
  PyObject* record;  // (param, 1.0)
  std::shared_ptr<Adoption>* adoption;  // null: not adopted
  // (param, scale) and (param, 1 / scale) of the last scale other than 1
  // it landed at (made again only for another scale).
  double scale;
  PyObject* scaled;
  PyObject* left;
  uint64_t left_in;  // the setting it was left scaled in (0: none)
};

int landing_traverse(PyObject* self, visitproc visit, void* arg) {
  auto* hook = reinterpret_cast<LandingHook*>(self);
  Py_VISIT(hook->fn);
  Py_VISIT(hook->record);
  Py_VISIT(hook->scaled);
  Py_VISIT(hook->left);
  if (hook->adoption != nullptr) {
    const Adoption& adoption = **hook->adoption;
    if (adoption.landing == self && adoption.holds.load()) {
      Py_VISIT(adoption.dict);
    }
  }
  return 0;
}

int landing_clear(PyObject* self) {
  auto* hook = reinterpret_cast<LandingHook*>(self);
  Py_CLEAR(hook->fn);
  Py_CLEAR(hook->record);
  Py_CLEAR(hook->scaled);
  Py_CLEAR(hook->left);
  return 0;
}

void landing_dealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  auto* hook = reinterpret_cast<LandingHook*>(self);
  if (hook->adoption != nullptr) {
    if ((*hook->adoption)->landing == self) {
      (*hook->adoption)->landing = nullptr;
    }
    delete hook->adoption;
    hook->adoption = nullptr;
  }
  landing_clear(self);
  delete hook->state;
  hook->state = nullptr;
  Py_TYPE(self)->tp_free(self);
}

// What landing hook ``hook`` does with gradient ``grad`` (null: none was
// given), the GIL held: 1, landed (the gradient passes on unchanged); 2,
// landed divided (``*out``); 0, not for the native landing (``fn(grad)``
// is); -1, a Python error set.
int land(LandingHook* hook, const at::Tensor* grad, at::Tensor* out) {
  LandingState& state = **hook->state;
  if (!state.running) return 1;
  if (!state.unit || state.record == nullptr || hook->record == nullptr) {
    return 0;
  }
  const double* found = state.unit->find(hook->impl);
  if (found == nullptr) return 0;
  double scale = *found;
  if (scale == 1.0) {
    return PyList_Append(state.record, hook->record) != 0 ? -1 : 1;
  }
  if (grad == nullptr) {
    PyErr_SetString(PyExc_TypeError, "gradient_scaling native: a "
                    "landing hook is called with one tensor");
    return -1;
  }
  PyObject* param = PyTuple_GET_ITEM(hook->record, 0);
  if (hook->left_in == state.setting) {
    PyErr_SetString(PyExc_RuntimeError,
                    "GradientScaling: a second gradient reached a "
                    "parameter in one planned backward pass (its first "
                    "is left scaled in .grad)");
    return -1;
  }
  double inverse = 1.0 / scale;
  if (hook->scale != scale || hook->scaled == nullptr) {
    PyObject* scaled = Py_BuildValue("(Od)", param, scale);
    PyObject* left = Py_BuildValue("(Od)", param, inverse);
    if (scaled == nullptr || left == nullptr) {
      Py_XDECREF(scaled);
      Py_XDECREF(left);
      return -1;
    }
    Py_XSETREF(hook->scaled, scaled);
    Py_XSETREF(hook->left, left);
    hook->scale = scale;
  }
  const at::Tensor& g = *grad;
  if (state.pending != nullptr &&
      state.excluded.count(hook->impl) == 0 &&
      (g.scalar_type() == at::kFloat || g.scalar_type() == at::kDouble) &&
      !g.is_sparse() && inverse >= std::ldexp(1.0, -126) &&
      inverse <= std::ldexp(1.0, 127) && !at::GradMode::is_enabled() &&
      !THPVariable_Unpack(param).grad().defined()) {
    if (PyList_Append(state.pending, hook->left) != 0 ||
        PyList_Append(state.record, hook->scaled) != 0) {
      return -1;
    }
    hook->left_in = state.setting;
    return 1;
  }
  *out = unscaled(g, scale);
  return PyList_Append(state.record, hook->scaled) != 0 ? -1 : 2;
}

PyObject* landing_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  auto* hook = reinterpret_cast<LandingHook*>(self);
  HANDLE_TH_ERRORS
  PyObject* grad = PyTuple_Size(args) == 1 ? PyTuple_GET_ITEM(args, 0)
                                           : nullptr;
  at::Tensor out;
  int landed = land(hook, grad != nullptr && THPVariable_Check(grad)
                              ? &THPVariable_Unpack(grad) : nullptr,
                    &out);
  if (landed < 0) return nullptr;
  if (landed == 1) Py_RETURN_NONE;
  if (landed == 2) return THPVariable_Wrap(out);
  if (hook->fn == nullptr) Py_RETURN_NONE;
  return PyObject_Call(hook->fn, args, kwargs);
  END_HANDLE_TH_ERRORS
}

PyTypeObject LandingHookType = {PyVarObject_HEAD_INIT(nullptr, 0)};

py::object landing_hook(Landing& landing, py::handle param, py::handle fn) {
  if (!THPVariable_Check(param.ptr())) {
    throw py::type_error("gradient_scaling native: not a tensor");
  }
  PyObject* record = Py_BuildValue("(Od)", param.ptr(), 1.0);
  if (record == nullptr) throw python_error();
  auto* hook = PyObject_GC_New(LandingHook, &LandingHookType);
  if (hook == nullptr) {
    Py_DECREF(record);
    throw python_error();
  }
  hook->state = new std::shared_ptr<LandingState>(landing.state);
  hook->impl = THPVariable_Unpack(param.ptr()).unsafeGetTensorImpl();
  Py_INCREF(fn.ptr());
  hook->fn = fn.ptr();
  hook->record = record;
  hook->adoption = nullptr;
  hook->scale = 0.0;
  hook->scaled = hook->left = nullptr;
  hook->left_in = 0;
  PyObject_GC_Track(reinterpret_cast<PyObject*>(hook));
  return py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(hook));
}

// A parameter's Python tensor hooks (PyTorch runs them from their
// dictionary, by one PyFunctionTensorPreHook among the tensor's hooks),
// holding that hook: while the adopted landing hook is the only one in
// the dictionary, it lands the gradient without a Python call (no Python
// tensor made for the gradient, no call through the dictionary); with
// another hook there (registered before GS's or after), or GS's gone,
// they run as PyTorch runs them, in order. Given back (detach), PyTorch's
// hook takes its place again and it is kept, never freed: an engine
// thread may be inside it (it then runs PyTorch's hook, ``python``).
struct LandingPreHook : torch::autograd::FunctionPreHook {
  std::unique_ptr<torch::autograd::FunctionPreHook> original;
  torch::autograd::FunctionPreHook* python = nullptr;  // original's
  size_t value_index = 0;  // the original's
  std::shared_ptr<Adoption> adoption;

  ~LandingPreHook() override { adoption->holds.store(false); }

  // PyTorch's hook back in ``slot`` (which holds this wrapper), in one
  // pointer store; the wrapper then owns itself (kept for good).
  void detach(std::unique_ptr<torch::autograd::FunctionPreHook>& slot) {
    adoption->holds.store(false);
    adoption->tensor.reset();
    slot.swap(original);
  }

  variable_list operator()(const variable_list& values) override {
    {
      py::gil_scoped_acquire gil;
      PyObject* landing = adoption->landing;
      if (landing == nullptr && original.get() != this) {
        // The landing hook went without giving PyTorch's hook back (its
        // handle removed by hand): given back now.
        auto impl = adoption->tensor.lock();
        if (impl) {
          at::Tensor tensor(std::move(impl));
          for (auto& h : torch::autograd::impl::hooks(tensor)) {
            if (h.get() == this) {
              detach(h);
              break;
            }
          }
        }
      }
      PyObject* key = nullptr;
      PyObject* value = nullptr;
      Py_ssize_t position = 0;
      size_t i = value_index;
      if (landing != nullptr && i < values.size() &&
          PyDict_GET_SIZE(adoption->dict) == 1 &&
          PyDict_Next(adoption->dict, &position, &key, &value) &&
          value == landing) {
        // (held while it lands: a collection inside may free its last
        // other reference)
        py::object held = py::reinterpret_borrow<py::object>(landing);
        at::Tensor out;
        int landed = land(reinterpret_cast<LandingHook*>(landing),
                          values[i].defined() ? &values[i] : nullptr, &out);
        if (landed < 0) throw python_error();
        if (landed == 1) return values;
        if (landed == 2) {
          variable_list result(values);
          result[i] = std::move(out);
          return result;
        }
      }
    }
    return (*python)(values);
  }

  void compiled_args(
      torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    python->compiled_args(args);
  }
};

// The hooks of ``tensor`` (PyTorch asserts it has autograd metadata),
// or null where it has none.
std::vector<std::unique_ptr<torch::autograd::FunctionPreHook>>*
tensor_hooks_of(const at::Tensor& tensor) {
  if (torch::autograd::impl::get_autograd_meta(tensor) == nullptr) {
    return nullptr;
  }
  return &torch::autograd::impl::hooks(tensor);
}

// The virtual table of PyTorch's PyFunctionTensorPreHook (whose type
// information it does not export): read once from a tensor of our own
// with one Python hook, so that a parameter's hook is known to be one.
const void* python_tensor_hooks_vtable() {
  static const void* vtable = nullptr;
  static bool tried = false;
  if (tried) return vtable;
  tried = true;
  try {
    at::Tensor probe = at::zeros({1});
    probe.set_requires_grad(true);
    py::object obj =
        py::reinterpret_steal<py::object>(THPVariable_Wrap(probe));
    if (!obj) throw python_error();
    obj.attr("register_hook")(py::cpp_function([](py::handle) {}));
    const auto& hooks = torch::autograd::impl::hooks(probe);
    if (hooks.size() == 1 && hooks[0]) {
      vtable = *reinterpret_cast<const void* const*>(hooks[0].get());
    }
  } catch (const std::exception&) {
    PyErr_Clear();  // (none adopted: the hooks run as PyTorch runs them)
    vtable = nullptr;
  }
  return vtable;
}

// Landing hook ``hook``, registered on ``param``, adopted (see
// LandingPreHook; again: the parameter's wrapper lands for it instead of
// the hook it adopted before); False where the parameter's Python hooks
// are not kept as expected (they then run as they do).
bool adopt_landing(py::handle param, py::handle hook) {
  if (!THPVariable_Check(param.ptr()) ||
      Py_TYPE(hook.ptr()) != &LandingHookType) {
    throw py::type_error("gradient_scaling native: adopt(tensor, landing "
                         "hook)");
  }
  PyObject* dict =
      reinterpret_cast<THPVariable*>(param.ptr())->backward_hooks;
  const void* vtable = python_tensor_hooks_vtable();
  if (dict == nullptr || !PyDict_Check(dict) || vtable == nullptr) {
    return false;
  }
  auto* landing = reinterpret_cast<LandingHook*>(hook.ptr());
  auto* hooks = tensor_hooks_of(THPVariable_Unpack(param.ptr()));
  if (hooks == nullptr) return false;
  for (auto& h : *hooks) {
    if (!h) continue;
    std::shared_ptr<Adoption> adoption;
    auto* wrapper = dynamic_cast<LandingPreHook*>(h.get());
    if (wrapper != nullptr) {
      if (wrapper->adoption->dict != dict) continue;
      adoption = wrapper->adoption;
    } else {
      if (*reinterpret_cast<const void* const*>(h.get()) != vtable) continue;
      auto* python =
          static_cast<torch::autograd::PyFunctionTensorPreHook*>(h.get());
      if (python->dict != dict) continue;
      adoption = std::make_shared<Adoption>();
      adoption->dict = dict;
      adoption->tensor = c10::weak_intrusive_ptr<c10::TensorImpl>(
          THPVariable_Unpack(param.ptr()).getIntrusivePtr());
      auto adopted = std::make_unique<LandingPreHook>();
      adopted->python = python;
      adopted->value_index = python->value_idx;
      adopted->adoption = adoption;
      adopted->original = std::move(h);
      h = std::move(adopted);
    }
    adoption->landing = hook.ptr();
    if (landing->adoption == nullptr) {
      landing->adoption = new std::shared_ptr<Adoption>(adoption);
    } else if (*landing->adoption != adoption) {
      if ((*landing->adoption)->landing == hook.ptr()) {
        (*landing->adoption)->landing = nullptr;  // (the other's no more)
      }
      *landing->adoption = adoption;
    }
    return true;
  }
  return false;
}

// The parameter's Python hooks run by PyTorch's own hook again, where a
// LandingPreHook holds it for landing hook ``hook`` (which goes).
void unadopt_landing(py::handle param, py::handle hook) {
  if (!THPVariable_Check(param.ptr())) {
    throw py::type_error("gradient_scaling native: not a tensor");
  }
  auto* hooks = tensor_hooks_of(THPVariable_Unpack(param.ptr()));
  if (hooks == nullptr) return;
  for (auto& h : *hooks) {
    auto* wrapper = dynamic_cast<LandingPreHook*>(h.get());
    if (wrapper != nullptr && wrapper->adoption->landing == hook.ptr()) {
      wrapper->adoption->landing = nullptr;
      wrapper->detach(h);
    }
  }
}

// Whether ``param``'s tensor hooks hold a LandingPreHook landing for a
// landing hook.
bool landing_adopted(py::handle param) {
  if (!THPVariable_Check(param.ptr())) {
    throw py::type_error("gradient_scaling native: not a tensor");
  }
  auto* hooks = tensor_hooks_of(THPVariable_Unpack(param.ptr()));
  if (hooks == nullptr) return false;
  for (auto& h : *hooks) {
    auto* wrapper = dynamic_cast<LandingPreHook*>(h.get());
    if (wrapper != nullptr && wrapper->adoption->landing != nullptr) {
      return true;
    }
  }
  return false;
}

// A class as a signature's number: a negative code of its own, the class
// kept alive (its address, and so its code, is never another class's).
int64_t class_code(PyTypeObject* type) {
  static PointerTable<int64_t> codes;
  const int64_t* found = codes.find(type);
  if (found != nullptr) return *found;
  Py_INCREF(reinterpret_cast<PyObject*>(type));
  int64_t code = -2 - static_cast<int64_t>(codes.size());
  codes.emplace(type, code);
  return code;
}

constexpr int64_t kNone = std::numeric_limits<int64_t>::min();

// The nodes of a graph in structure order, their Python objects made only
// when asked (making one for each of a graph's nodes cost about half of
// the read). A node's object, once made, is kept: the node's own, so that
// every way to it (``grad_fn``, ``next_functions``, this) gives the same.
struct NodeList {
  std::vector<c10::intrusive_ptr<Node>> nodes;
  std::vector<py::object> objects;  // (null until asked)
  PointerTable<Py_ssize_t> index;

  Py_ssize_t size() const { return static_cast<Py_ssize_t>(nodes.size()); }

  py::object object(Py_ssize_t i) {
    py::object& known = objects[static_cast<size_t>(i)];
    if (!known) {
      PyObject* obj = torch::autograd::functionToPyObject(nodes[i]);
      if (obj == nullptr) throw python_error();
      known = py::reinterpret_steal<py::object>(obj);
    }
    return known;
  }

  Py_ssize_t checked(Py_ssize_t i) const {
    Py_ssize_t n = size();
    if (i < 0) i += n;
    if (i < 0 || i >= n) throw py::index_error("node position out of range");
    return i;
  }

  // The position of the node of Python object ``obj``, or -1.
  Py_ssize_t position(py::handle obj) const {
    PyObject* o = obj.ptr();
    const Node* node = nullptr;
    if (torch::autograd::THPCppFunction_Check(o)) {
      node = reinterpret_cast<torch::autograd::THPCppFunction*>(o)->cdata
                 .get();
    } else if (THPFunction_Check(o)) {
      node = reinterpret_cast<THPFunction*>(o)->cdata.get();
    }
    if (node == nullptr) return -1;
    const Py_ssize_t* found = index.find(node);
    return found == nullptr ? -1 : *found;
  }
};

// What the structure read needs of a node's C++ type, kept per type (its
// vtable's address: one per most-derived class): its Python class's code
// (PyTorch's table gives a C++ node type its class, filled as its module
// loads; read from the first object of that type made), whether it is a
// Python function's node (a THPFunction's: one C++ type for all, a class
// per function, read from its object each time), whether it accumulates.
struct NodeType {
  int64_t code;
  bool python;
  bool accumulate;
};

const void* vtable_of(const Node* node) {
  return *reinterpret_cast<const void* const*>(node);
}

// The code of node ``node``'s Python class, without making its object
// where it need not be (``made``: an object made or read, kept); whether
// it accumulates into a leaf (``accumulate``).
int64_t node_code(const c10::intrusive_ptr<Node>& node, py::object* made,
                  bool* accumulate) {
  static PointerTable<NodeType> types;
  const void* vtable = vtable_of(node.get());
  const NodeType* found = types.find(vtable);
  if (found != nullptr && !found->python) {
    *accumulate = found->accumulate;
    return found->code;
  }
  PyObject* obj = torch::autograd::functionToPyObject(node);
  if (obj == nullptr) throw python_error();
  *made = py::reinterpret_steal<py::object>(obj);
  int64_t code = class_code(Py_TYPE(obj));
  bool is_accumulate =
      dynamic_cast<torch::autograd::AccumulateGrad*>(node.get()) != nullptr;
  // (looked up again: making the object may have run Python, a collection
  // whose finalisers read a structure; emplace keeps what is there)
  types.emplace(vtable, NodeType{code, THPFunction_Check(obj) != 0,
                                 is_accumulate});
  *accumulate = is_accumulate;
  return code;
}

// A NodeList as a sequence (``order``)...
struct NodeOrder {
  std::shared_ptr<NodeList> list;
};

// ... and as a mapping node -> position (``index``).
struct NodePositions {
  std::shared_ptr<NodeList> list;
};

// graph.python_structure(roots), read in one call: (nodes in the order
// first met, breadth first; node -> position; the signature). The nodes
// and positions are the Python function's, as a NodeOrder and a
// NodePositions (their objects made when asked); the signature is its
// tuple written as int64 numbers in bytes (None, a class, a number each its
// own code): two graphs' signatures are equal exactly when the Python ones
// are.
py::tuple structure(py::sequence roots) {
  auto list = std::make_shared<NodeList>();
  auto& index = list->index;
  auto& nodes = list->nodes;
  auto& objects = list->objects;
  std::vector<int64_t> signature;
  index.reserve(256);
  nodes.reserve(256);
  signature.reserve(1024);
  std::vector<std::pair<size_t, py::object>> known;  // (roots' objects)

  auto visit = [&](const c10::intrusive_ptr<Node>& producer) -> Py_ssize_t {
    auto inserted = index.emplace(producer.get(),
                                  static_cast<Py_ssize_t>(nodes.size()));
    if (inserted.second) nodes.push_back(producer);
    return *inserted.first;
  };

  for (auto root : roots) {
    if (root.is_none()) {
      signature.push_back(kNone);
      continue;
    }
    size_t before = nodes.size();
    signature.push_back(visit(node_of(root.ptr())));
    if (nodes.size() > before) {
      known.emplace_back(before, py::reinterpret_borrow<py::object>(root));
    }
    signature.push_back(kNone);  // (a root's slot is None)
  }
  objects.resize(nodes.size());
  for (auto& k : known) objects[k.first] = std::move(k.second);
  for (size_t following = 0; following < nodes.size(); ++following) {
    Node* node = nodes[following].get();  // (kept by nodes: the vector may
                                          // grow, the node stays)
    bool accumulate = false;
    py::object made;
    signature.push_back(node_code(nodes[following], &made, &accumulate));
    if (made && (following >= objects.size() || !objects[following])) {
      objects.resize(nodes.size());  // (a root's object is the one given)
      objects[following] = std::move(made);
    }
    const auto& edges = node->next_edges();
    if (edges.empty() && accumulate) {
      auto* acc = static_cast<torch::autograd::AccumulateGrad*>(node);
      PyObject* variable = THPVariable_Wrap(acc->variable);
      if (variable == nullptr) throw python_error();
      signature.push_back(static_cast<int64_t>(
          reinterpret_cast<uintptr_t>(variable)));
      signature.push_back(class_code(Py_TYPE(variable)));
      Py_DECREF(variable);
      continue;
    }
    signature.push_back(static_cast<int64_t>(edges.size()));
    for (const auto& edge : edges) {
      if (!edge.is_valid()) {
        signature.push_back(kNone);
        continue;
      }
      signature.push_back(visit(edge.function));
      signature.push_back(static_cast<int64_t>(edge.input_nr));
    }
  }
  objects.resize(nodes.size());
  PyObject* bytes = PyBytes_FromStringAndSize(
      reinterpret_cast<const char*>(signature.data()),
      static_cast<Py_ssize_t>(signature.size() * sizeof(int64_t)));
  if (bytes == nullptr) throw python_error();
  return py::make_tuple(NodeOrder{list}, NodePositions{list},
                        py::reinterpret_steal<py::object>(bytes));
}

// internals.leaves_with_other_hooks: the tensors of ``leaves`` with a
// tensor hook besides their first (a GS landing hook) or a
// post-accumulate-grad hook, read from each tensor's own fields.
py::list leaves_with_other_hooks(py::iterable leaves) {
  py::list out;
  for (auto leaf : leaves) {
    if (!THPVariable_Check(leaf.ptr())) {
      throw py::type_error("gradient_scaling native: a leaf that is not a "
                           "tensor");
    }
    auto* variable = reinterpret_cast<THPVariable*>(leaf.ptr());
    Py_ssize_t hooks = 0, post = 0;
    if (variable->backward_hooks != nullptr &&
        variable->backward_hooks != Py_None) {
      hooks = PyObject_Length(variable->backward_hooks);
    }
    if (variable->post_accumulate_grad_hooks != nullptr &&
        variable->post_accumulate_grad_hooks != Py_None) {
      post = PyObject_Length(variable->post_accumulate_grad_hooks);
    }
    if (hooks < 0 || post < 0) throw python_error();
    if (post != 0 || hooks != 1) out.append(leaf);
  }
  return out;
}

// How many devices the tensors of ``leaves`` are on.
size_t leaf_devices(py::iterable leaves) {
  std::vector<at::Device> devices;
  for (auto leaf : leaves) {
    if (!THPVariable_Check(leaf.ptr())) {
      throw py::type_error("gradient_scaling native: a leaf that is not a "
                           "tensor");
    }
    at::Device device = THPVariable_Unpack(leaf.ptr()).device();
    if (std::find(devices.begin(), devices.end(), device) == devices.end()) {
      devices.push_back(device);
    }
  }
  return devices.size();
}

// internals.input_dtype: the dtype of gradient slot ``slot`` of ``node``.
at::ScalarType input_dtype(py::handle node, int64_t slot) {
  auto n = node_of(node.ptr());
  if (slot < 0 || static_cast<uint32_t>(slot) >= n->num_inputs()) {
    throw py::index_error("gradient_scaling native: no such gradient slot");
  }
  return c10::typeMetaToScalarType(n->input_metadata(slot).dtype());
}

// The common case of gradient_scaling.torch.hook's _all_finite, in one
// call: ``tensors`` and ``losses`` checked into ``found`` (the flag of the
// division in place, on the device of all of them), then ``found`` read
// (the step's one host read): the small dense CPU ones (loop_ready) by a
// loop, the others (a copy of each loss) by GradScaler's kernel,
// multiplied by ``one``, which is 1. None where the kernel refuses them
// (another device, dtype or layout): the caller checks them as it would
// have.
py::object finite_into(std::vector<at::Tensor> tensors,
                       const std::vector<at::Tensor>& losses,
                       at::Tensor found, const at::Tensor& one) {
  for (const auto& loss : losses) {  // (a loop reads one in place)
    tensors.push_back(loop_ready(loss) ? loss : loss.reshape(-1).clone());
  }
  for (const auto& t : tensors) {
    if (t.device() != found.device() || t.layout() != at::kStrided) {
      return py::none();
    }
  }
  // The small dense CPU ones read by a loop (the kernel would multiply
  // them by 1, which changes no value), the others by the kernel.
  std::vector<at::Tensor> others;
  for (const auto& t : tensors) {
    if (!loop_ready(t)) {
      others.push_back(t);
    } else if (!finite_loop(t)) {
      found.fill_(1.0);  // (as the kernel leaves it)
      return py::bool_(false);
    }
  }
  if (!others.empty()) {
    try {
      at::_amp_foreach_non_finite_check_and_unscale_(others, found, one);
    } catch (const c10::Error&) {
      return py::none();
    }
  }
  return py::bool_(found.item<double>() == 0);
}

// The gradients of ``leaves`` (in order; None ones left out) that no
// division read in place: not a parameter of the lists of ``divided``
// (each a native division's) nor one whose ``id`` is in the set
// ``done`` (the Python division's).
std::vector<at::Tensor> unchecked_tensors(py::iterable leaves,
                                          py::iterable divided,
                                          py::handle done) {
  PointerTable<char> read;
  for (auto list : divided) {
    for (auto param : list) read.emplace(param.ptr(), 1);
  }
  if (!PyAnySet_Check(done.ptr())) {
    throw py::type_error("gradient_scaling native: done is not a set");
  }
  bool ids = PySet_GET_SIZE(done.ptr()) > 0;
  std::vector<at::Tensor> out;
  for (auto leaf : leaves) {
    if (read.find(leaf.ptr()) != nullptr) continue;
    if (ids) {
      PyObject* key = PyLong_FromVoidPtr(leaf.ptr());
      if (key == nullptr) throw python_error();
      int in = PySet_Contains(done.ptr(), key);
      Py_DECREF(key);
      if (in < 0) throw python_error();
      if (in == 1) continue;
    }
    if (!THPVariable_Check(leaf.ptr())) {
      throw py::type_error("gradient_scaling native: a leaf that is not a "
                           "tensor");
    }
    const at::Tensor& grad = THPVariable_Unpack(leaf.ptr()).grad();
    if (grad.defined()) out.push_back(grad);
  }
  return out;
}

// unchecked_tensors as Python tensors.
py::list unchecked_grads(py::iterable leaves, py::iterable divided,
                         py::handle done) {
  py::list out;
  for (const auto& grad : unchecked_tensors(leaves, divided, done)) {
    out.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(grad)));
  }
  return out;
}

// Whether a parameter of ``groups`` (an optimizer's ``param_groups``:
// dictionaries, each with its ``params``) has a float16 gradient
// (GradScaler's refusal to unscale one), read from each tensor's own
// field.
bool half_gradients(py::iterable groups) {
  for (auto group : groups) {
    py::object params = py::reinterpret_borrow<py::object>(group)["params"];
    for (auto param : params) {
      if (!THPVariable_Check(param.ptr())) {
        throw py::type_error("gradient_scaling native: a parameter that is "
                             "not a tensor");
      }
      const at::Tensor& grad = THPVariable_Unpack(param.ptr()).grad();
      if (grad.defined() && grad.scalar_type() == at::kHalf) return true;
    }
  }
  return false;
}

// The pass's final check where no division made a flag: finite_into
// with a flag made here, on the device of the first of ``tensors`` (or of
// ``losses``); none made where a loop reads them all. None where that
// does not apply.
py::object finite_all(std::vector<at::Tensor> tensors,
                      const std::vector<at::Tensor>& losses) {
  if (tensors.empty() && losses.empty()) return py::bool_(true);
  const std::vector<at::Tensor>* lists[] = {&tensors, &losses};
  bool loops = true;  // (then no flag is made, nor read)
  for (const auto* list : lists) {
    for (const auto& t : *list) loops = loops && loop_ready(t);
  }
  if (loops) {
    for (const auto* list : lists) {
      for (const auto& t : *list) {
        if (!finite_loop(t)) return py::bool_(false);
      }
    }
    return py::bool_(true);
  }
  at::Device device =
      tensors.empty() ? losses[0].device() : tensors[0].device();
  at::Tensor found;
  try {
    found = at::zeros({1}, at::TensorOptions().dtype(at::kFloat)
                               .device(device));
  } catch (const c10::Error&) {
    return py::none();
  }
  return finite_into(std::move(tensors), losses, found,
                     inverse_on(1.0, device));
}

// The pass's final check of the gradients of ``leaves`` that no division
// read (unchecked_grads's, not made Python tensors) and ``losses``:
// finite_into with ``found`` (the division's flag, a one-element tensor)
// or, None, finite_all.
py::object leaves_finite(py::iterable leaves, py::iterable divided,
                         py::handle done,
                         const std::vector<at::Tensor>& losses,
                         py::handle found) {
  std::vector<at::Tensor> grads = unchecked_tensors(leaves, divided, done);
  if (found.is_none()) return finite_all(std::move(grads), losses);
  if (!THPVariable_Check(found.ptr())) {
    throw py::type_error("gradient_scaling native: a pass's flag that is "
                         "not a tensor");
  }
  const at::Tensor& flag = THPVariable_Unpack(found.ptr());
  return finite_into(std::move(grads), losses, flag,
                     inverse_on(1.0, flag.device()));
}

// -- what a refresh reads of a tensor (TorchOps's statistics) -------------
//
// The same ATen operations as gradient_scaling/torch/arrays.py's, in one
// call (the same numbers, bit for bit: they sum in the same order); the
// finiteness of a small dense CPU tensor read by a loop here (a yes or
// no: no rounding to differ).

// Whether every one of ``n`` float64 values is finite and non-zero (a
// refresh's log-normal read then selects them all), read by a loop: a
// yes or no, no rounding to differ.
bool finite_and_nonzero(const double* data, int64_t n) {
  const uint64_t* bits = reinterpret_cast<const uint64_t*>(data);
  const uint64_t exponent = 0x7ff0000000000000ull;
  const uint64_t magnitude = 0x7fffffffffffffffull;
  bool excluded = false;
  for (int64_t i = 0; i < n; ++i) {
    excluded |= ((bits[i] & exponent) == exponent) |
                ((bits[i] & magnitude) == 0);
  }
  return !excluded;
}

// TorchOps.finite_witness: 0 where every element of ``x`` is finite, NaN
// otherwise, a 0-d tensor of the default dtype on x's device (no host
// read of a device's tensor).
at::Tensor finite_witness(const at::Tensor& given) {
  at::Tensor x = given.detach();
  if (loop_ready(x)) {
    bool finite = finite_loop(x);
    return at::scalar_tensor(
        finite ? 0.0 : std::numeric_limits<double>::quiet_NaN(),
        at::TensorOptions().dtype(
            c10::typeMetaToScalarType(c10::get_default_dtype())));
  }
  return at::where(at::isfinite(x).all(), 0.0,
                   std::numeric_limits<double>::quiet_NaN());
}

// The SavedVariable ``field`` of a GEMM's node (graph.py's _INPUT_FIELD:
// AddmmBackward0's mat1 and mat2, MmBackward0's and BmmBackward0's self and
// mat2, ConvolutionBackward0's input), as ``node._saved_<field>`` reads it.
const torch::autograd::SavedVariable& gemm_saved(Node* node,
                                                 const std::string& field) {
  namespace gen = torch::autograd::generated;
  if (auto* n = dynamic_cast<gen::AddmmBackward0*>(node)) {
    if (field == "mat1") return n->mat1_;
    if (field == "mat2") return n->mat2_;
  } else if (auto* n = dynamic_cast<gen::MmBackward0*>(node)) {
    if (field == "self") return n->self_;
    if (field == "mat2") return n->mat2_;
  } else if (auto* n = dynamic_cast<gen::BmmBackward0*>(node)) {
    if (field == "self") return n->self_;
    if (field == "mat2") return n->mat2_;
  } else if (auto* n = dynamic_cast<gen::ConvolutionBackward0*>(node)) {
    if (field == "input") return n->input_;
  }
  throw py::value_error("gradient_scaling native: no saved field " + field +
                        " of " + node->name());
}

// finite_witness of the tensor ``node`` saved as ``field`` (graph.py's
// ``internals.saved(node, field)``), None where that gives None: a tensor
// saved through hooks (unpacking it has effects: only the node does it),
// freed by a backward that ran, or not saved.
py::object saved_finite_witness(py::handle node, const std::string& field) {
  auto n = node_of(node.ptr());
  at::Tensor witness;
  {
    py::gil_scoped_release released;
    witness = saved_witness(n, field);
  }
  if (!witness.defined()) return py::none();
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(witness));
}

// saved_finite_witness's witness (undefined for None), without the GIL.
at::Tensor saved_witness(const c10::intrusive_ptr<Node>& n,
                         const std::string& field) {
  const auto& saved = gemm_saved(n.get(), field);
  if (saved.has_hooks()) return at::Tensor();
  at::Tensor x;
  try {
    x = saved.unpack(n);
  } catch (const c10::Error&) {
    // (freed: undefined, as not saved)
  }
  return x.defined() ? finite_witness(x) : at::Tensor();
}

// saved_finite_witness of each ``(node, field)`` of ``sites``, in one call
// (a refresh's GEMM sites, read at its first one, while all are alive).
py::list saved_finite_witnesses(const py::list& sites) {
  py::list out;
  for (py::handle site : sites) {
    auto pair = site.cast<py::tuple>();
    out.append(saved_finite_witness(pair[0],
                                    pair[1].cast<std::string>()));
  }
  return out;
}

// The values of 0-d tensors of one dtype, with one host read (arrays.py's
// ``_values``: stacked, in float64 where their dtypes differ).
std::vector<double> values_of(std::vector<at::Tensor> tensors) {
  bool direct = true;  // (float64 CPU scalars: read where they are)
  for (const auto& t : tensors) {
    direct = direct && t.device().is_cpu() &&
             t.scalar_type() == at::kDouble && t.numel() == 1 &&
             t.layout() == at::kStrided && !t.is_neg() &&
             t.has_storage() && plain_tensor(t);
  }
  if (direct) {
    std::vector<double> values;
    values.reserve(tensors.size());
    for (const auto& t : tensors) values.push_back(*t.data_ptr<double>());
    return values;
  }
  for (auto& t : tensors) t = t.to(at::kDouble);
  at::Tensor stacked = at::stack(tensors);
  if (!stacked.device().is_cpu()) stacked = stacked.cpu();
  const double* v = stacked.data_ptr<double>();
  return std::vector<double>(v, v + stacked.numel());
}

// Whether small_spread_and_max (below) reads ``given``.
bool small_spread_readable(const at::Tensor& given, int64_t limit) {
  // (a plain tensor first: its size is asked of no Python)
  if (!plain_tensor(given) || given.layout() != at::kStrided ||
      !(given.device().is_cpu() || given.device().is_cuda())) {
    return false;
  }
  auto dtype = given.scalar_type();
  const int64_t n = given.numel();
  return (dtype == at::kFloat || dtype == at::kHalf ||
          dtype == at::kBFloat16) && n != 0 && n <= limit;
}

// The sum of ``n`` values, and the sum of their squares, in float64 and
// in lanes (arrays.py's _lane_sums, the same additions in the same order):
// value i goes to lane i % 8, each lane summed in order from 0.0, the
// eight lanes then combined as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)).
// A fixed order, which a loop keeps at a loop's speed (eight running sums
// are eight independent chains; ATen's sum and dot of a small tensor cost
// a few microseconds each in dispatch and intermediate tensors). Value i
// is ``v[i]`` widened, less ``mean`` (0 but where centred), one IEEE
// subtraction; its square one IEEE product (no contraction: the build's
// -ffp-contract).
constexpr int64_t kLanes = 8;

struct LaneSums {
  double total, squares;
};

inline double combined(const double* lane) {
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) +
         ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

template <typename T>
LaneSums lane_sums(const T* v, int64_t n, double mean) {
  double sums[kLanes] = {};
  double squares[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const double x = static_cast<double>(v[i + j]) - mean;
      sums[j] += x;
      squares[j] += x * x;
    }
  }
  for (; i < n; ++i) {
    const double x = static_cast<double>(v[i]) - mean;
    sums[i % kLanes] += x;
    squares[i % kLanes] += x * x;
  }
  return {combined(sums), combined(squares)};
}

// The spread read of values whose max|x| is ``largest``, not finite or 0:
// (NaN, largest), or (0, 0).
std::tuple<double, double> spread_of(double largest) {
  if (largest == 0) return std::make_tuple(0.0, 0.0);
  return std::make_tuple(std::numeric_limits<double>::quiet_NaN(), largest);
}

// TorchOps.spread_and_max of a plain float32 (or float16, bfloat16: they
// widen exactly) CPU or CUDA tensor of 1 to ``limit`` elements: arrays.py's
// _small_spread_and_max, the same sums and the arithmetic on them, in one
// call: (standard deviation, max |x|); nothing for another tensor (Python
// reads it). On the CPU its values are read by loops, as float32 (a copy
// where they are not a plain row-major float32 tensor's): max|x| (NaN
// where a value is; a maximum: no order to keep), then the sums in lanes
// (lane_sums) only where a finite, non-zero maximum needs them. Where a
// dispatch mode is on (its operations are Python's to see), nothing. On
// a CUDA device, ATen's reductions in float64.
std::optional<std::tuple<double, double>> small_spread_and_max(
    const at::Tensor& given, int64_t limit) {
  if (!small_spread_readable(given, limit)) return std::nullopt;
  const int64_t n = given.numel();
  const double count = static_cast<double>(n);
  double largest, total, squares;
  if (given.device().is_cpu()) {
    if (c10::impl::dispatch_mode_enabled()) return std::nullopt;
    at::Tensor x = given;
    if (!loop_readable(given) || given.scalar_type() != at::kFloat) {
      x = given.detach().resolve_neg().reshape(-1).to(at::kFloat)
              .contiguous();
    }
    const float* values = x.data_ptr<float>();
    largest = max_abs_float(values, n);
    if (!std::isfinite(largest) || largest == 0) return spread_of(largest);
    LaneSums sums = lane_sums(values, n, 0.0);
    total = sums.total;
    squares = sums.squares;
    if (total * total > 0.5 * count * squares) {  // centred first
      sums = lane_sums(values, n, total / count);
      total = sums.total;
      squares = sums.squares;
    }
  } else {
    at::Tensor y = given.detach().reshape(-1).to(at::kDouble);
    auto extremes = at::aminmax(y);
    std::vector<double> v = values_of(
        {std::get<0>(extremes), std::get<1>(extremes), y.sum(),
         at::dot(y, y)});
    const double low = v[0], high = v[1];
    largest = high > -low ? high : -low;  // max(-low, high)
    if (!std::isfinite(largest) || largest == 0) return spread_of(largest);
    total = v[2];
    squares = v[3];
    if (total * total > 0.5 * count * squares) {  // centred first
      at::Tensor d = y - total / count;
      v = values_of({d.sum(), at::dot(d, d)});
      total = v[0];
      squares = v[1];
    }
  }
  const double mean = total / count;
  double var = squares / count - mean * mean;
  if (0.0 > var) var = 0.0;  // max(var, 0.0)
  return std::make_tuple(std::sqrt(var), largest);
}

// rules.py's pow2_ceil and pow2_floor of a positive finite x (frexp reads
// its exponent: exact).
double pow2_ceil(double x) {
  int exponent;
  const double mantissa = std::frexp(x, &exponent);
  return std::ldexp(1.0, mantissa == 0.5 ? exponent - 1 : exponent);
}

double pow2_floor(double x) {
  int exponent;
  std::frexp(x, &exponent);
  return std::ldexp(1.0, exponent - 1);
}

// estimators.py's ModelEstimator.gemm (Theorem 1, capped: underflow.py's
// gemm_scale_from_stats and _power_of_two_scale, the same operations in
// the same order) for an incoming gradient and a weight that
// small_spread_and_max reads: both reads and the scale in one call,
// (beta, std(g), max|g|, std(W), max|W|); beta NaN where a read is not
// finite (the weight then unread where the gradient is not); nothing
// where either tensor is not such a tensor, or n < 1 (Python reads them,
// and raises). ``coefficient``: underflow.gemm_target_coefficient's.
std::optional<std::tuple<double, double, double, double, double>>
gemm_model_scale(const at::Tensor& grad, const at::Tensor& weight,
                 int64_t n, double coefficient, double fmt_max,
                 int64_t limit) {
  constexpr double kMinScale = 0x1p-126, kMaxScale = 0x1p126;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  if (n < 1 || !small_spread_readable(weight, limit)) return std::nullopt;
  auto g = small_spread_and_max(grad, limit);
  if (!g) return std::nullopt;
  const double g_std = std::get<0>(*g), g_max = std::get<1>(*g);
  if (!std::isfinite(g_max)) {
    return std::make_tuple(nan, g_std, g_max, nan, nan);
  }
  auto w = small_spread_and_max(weight, limit);
  const double w_std = std::get<0>(*w), w_max = std::get<1>(*w);
  if (!std::isfinite(w_max)) {
    return std::make_tuple(nan, g_std, g_max, w_std, w_max);
  }
  const double length = static_cast<double>(n);
  double target = 1.0;
  if (g_std != 0 && w_std != 0) {
    target = coefficient / std::sqrt(length) / g_std / w_std;
  }
  const double cap = (g_max == 0 || w_max == 0)
                         ? std::numeric_limits<double>::infinity()
                         : fmt_max / length / g_max / w_max;
  double scale = target < kMaxScale ? pow2_ceil(target > 1.0 ? target : 1.0)
                                    : kMaxScale;
  if (cap < scale) scale = cap >= kMinScale ? pow2_floor(cap) : kMinScale;
  return std::make_tuple(scale, g_std, g_max, w_std, w_max);
}

// lane_sums of a flat float64 CPU tensor that no loop here reads (a
// subclass's, or under a dispatch mode), by ATen's operations: arrays.py's
// _lane_sums, the same operations (a cumulative sum per lane, in order).
LaneSums lane_sums_by_aten(const at::Tensor& y) {
  at::Tensor rows = at::stack({y, y * y});
  const int64_t pad = (kLanes - y.numel() % kLanes) % kLanes;
  if (pad) rows = at::constant_pad_nd(rows, {0, pad});
  at::Tensor last = rows.reshape({2, -1, kLanes}).cumsum(1).select(1, -1)
                        .to(at::kDouble).cpu().contiguous();
  const double* lanes = last.data_ptr<double>();
  return {combined(lanes), combined(lanes + kLanes)};
}

// The mean and variance of a flat float64 CPU tensor ``v`` in two passes
// of lane sums (arrays.py's _lane_moments): the sum gives the mean, the
// squares of the deviations from it the variance; (0, 0) where empty.
std::pair<double, double> lane_moments(const at::Tensor& v) {
  const int64_t n = v.numel();
  if (n == 0) return {0.0, 0.0};
  const double count = static_cast<double>(n);
  if (loop_ready(v)) {
    const double* values = v.data_ptr<double>();
    const double mean = lane_sums(values, n, 0.0).total / count;
    return {mean, lane_sums(values, n, mean).squares / count};
  }
  const double mean = lane_sums_by_aten(v).total / count;
  return {mean, lane_sums_by_aten(v - mean).squares / count};
}

// TorchOps.log_statistics's reads of ``x``: (count, finite count, mean,
// variance, max |x|, non-zero count, mean and variance of log |x|), over
// its finite values (in float64): a CPU tensor of up to kSmallLoop
// elements with its moments in lanes (lane_moments), another with ATen's
// var_mean, as arrays.py's _log_moments.
std::tuple<int64_t, double, double, double, double, int64_t, double, double>
log_moments(const at::Tensor& given) {
  at::Tensor x = given.detach().to(at::kDouble).reshape(-1);
  if (x.device().is_cpu() && x.numel() <= kSmallLoop) {
    if (x.numel() > 0 && loop_ready(x) &&
        finite_and_nonzero(x.data_ptr<double>(), x.numel())) {
      // (both masks select every value, in order: the same values reduced
      // in the same order, without the two selections)
      at::Tensor logs = at::log(x.abs());
      auto plain = lane_moments(x);
      auto logged = lane_moments(logs);
      const double n = static_cast<double>(x.numel());
      return std::make_tuple(x.numel(), n, plain.first, plain.second,
                             max_abs_loop(x.data_ptr<double>(), x.numel()),
                             x.numel(), logged.first, logged.second);
    }
    at::Tensor finite = at::isfinite(x);
    at::Tensor values = x.index({finite});
    at::Tensor magnitudes = values.abs();
    at::Tensor logs = at::log(magnitudes.index({magnitudes != 0}));
    auto plain = lane_moments(values);
    auto logged = lane_moments(logs);
    const double largest =
        values.numel() ? magnitudes.max().item<double>() : 0.0;
    return std::make_tuple(x.numel(), static_cast<double>(values.numel()),
                           plain.first, plain.second, largest, logs.numel(),
                           logged.first, logged.second);
  }
  // (a CUDA tensor, or a larger one: ATen's reductions, one launch each)
  at::Tensor finite = at::isfinite(x);
  at::Tensor values = x.index({finite});
  at::Tensor magnitudes = values.abs();
  at::Tensor logs = at::log(magnitudes.index({magnitudes != 0}));
  at::Tensor zero = at::zeros({}, x.options());
  auto moments = [&](const at::Tensor& v) {
    if (v.numel() == 0) return std::make_pair(zero, zero);
    auto var_mean = at::var_mean(v, c10::nullopt, 0);
    return std::make_pair(std::get<1>(var_mean), std::get<0>(var_mean));
  };
  auto plain = moments(values);
  auto logged = moments(logs);
  std::vector<double> v = values_of(
      {finite.sum(), plain.first, plain.second,
       values.numel() ? magnitudes.max() : zero, logged.first,
       logged.second});
  return std::make_tuple(x.numel(), v[0], v[1], v[2], v[3], logs.numel(),
                         v[4], v[5]);
}

// The objects of the nodes at ``positions``.
py::list take(NodeOrder& order, const std::vector<Py_ssize_t>& positions) {
  py::list out(positions.size());
  size_t k = 0;
  for (Py_ssize_t i : positions) {
    out[k++] = order.list->object(order.list->checked(i));
  }
  return out;
}

// The tensors of the accumulation nodes at ``positions``.
py::list variables(NodeOrder& order,
                   const std::vector<Py_ssize_t>& positions) {
  py::list out(positions.size());
  size_t k = 0;
  for (Py_ssize_t i : positions) {
    const auto& node = order.list->nodes[order.list->checked(i)];
    auto* accumulate =
        dynamic_cast<torch::autograd::AccumulateGrad*>(node.get());
    if (accumulate == nullptr) {
      throw py::value_error("gradient_scaling native: not an accumulation "
                            "node");
    }
    PyObject* variable = THPVariable_Wrap(accumulate->variable);
    if (variable == nullptr) throw python_error();
    out[k++] = py::reinterpret_steal<py::object>(variable);
  }
  return out;
}

py::list all_objects(NodeList& list) {
  py::list out(list.nodes.size());
  for (Py_ssize_t i = 0; i < list.size(); ++i) out[i] = list.object(i);
  return out;
}

void HookSet::add_planned_events(py::handle order, const PlannedTable& table,
                                 const PlannedEvents& events) {
  if (!py::isinstance<NodeOrder>(order)) {
    // (a list of node objects: the Python structure's)
    py::list nodes = py::reinterpret_borrow<py::list>(order);
    Py_ssize_t size = static_cast<Py_ssize_t>(nodes.size());
    for (const auto& e : events.events) {
      if (e.position < 0 || e.position >= size) {
        throw py::index_error("gradient_scaling native: a planned hook's "
                              "node is not in the graph");
      }
      add_planned(nodes[e.position], table, e.post, e.seq, e.slots);
    }
    return;
  }
  const NodeList& list = *order.cast<NodeOrder&>().list;
  for (const auto& e : events.events) {
    if (e.position < 0 || e.position >= list.size()) {
      throw py::index_error("gradient_scaling native: a planned hook's "
                            "node is not in the graph");
    }
    mark_hooked(*table.state, e.seq);
    const auto& node = list.nodes[e.position];
    if (e.post) {
      add_on<PlannedPostHook>(node, table.state, e.seq, e.slots);
    } else {
      add_on<PlannedPreHook>(node, table.state, e.seq, e.slots);
    }
  }
}

void HookSet::add_speculative_branches_at(
    py::handle order, const Speculation& speculation,
    std::vector<std::tuple<Py_ssize_t, int64_t,
                           std::vector<std::tuple<int64_t, int64_t, double>>>>
        consumers) {
  const NodeList& list = *order.cast<NodeOrder&>().list;
  const auto branches =
      static_cast<int64_t>(speculation.state->branches.size());
  for (auto& c : consumers) {
    const Py_ssize_t position = std::get<0>(c);
    if (position < 0 || position >= list.size()) {
      throw py::index_error("gradient_scaling native: a speculated "
                            "hook's node is not in the graph");
    }
    for (const auto& edge : std::get<2>(c)) {
      if (std::get<1>(edge) < 0 || std::get<1>(edge) >= branches) {
        throw py::index_error("gradient_scaling native: a branch the "
                              "speculation does not hold");
      }
    }
    add_on<SpeculativeBranchHook>(list.nodes[position], speculation.state,
                                  std::get<1>(c), std::move(std::get<2>(c)));
  }
}

void HookSet::add_speculative_at(py::handle order,
                                 const Speculation& speculation,
                                 py::list events) {
  const NodeList& list = *order.cast<NodeOrder&>().list;
  for (py::handle item : events) {
    auto e = item.cast<py::tuple>();
    auto position = e[0].cast<Py_ssize_t>();
    if (position < 0 || position >= list.size()) {
      throw py::index_error("gradient_scaling native: a speculated "
                            "hook's node is not in the graph");
    }
    speculate_on(list.nodes[position], speculation, e[1].cast<int64_t>(),
                 py::reinterpret_borrow<py::object>(e[2]), e[3],
                 e[4].cast<int64_t>(), e[5].cast<int64_t>(),
                 e[6].cast<double>(), e[7].cast<double>(),
                 e[8].cast<int64_t>(), e[9].cast<double>(),
                 e[10].cast<double>(), e[11].cast<std::string>());
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "gradient_scaling's native callbacks (see native.py)";
  py::class_<HookSet>(m, "HookSet")
      .def(py::init<>())
      .def("add_pre", &HookSet::add_pre)
      .def("add_post", &HookSet::add_post)
      .def("add_scaling_pre", &HookSet::add_scaling_pre)
      .def("add_scaling_post", &HookSet::add_scaling_post)
      .def("add_refresh_read", &HookSet::add_refresh_read)
      .def("take_reads", &HookSet::take_reads)
      .def("add_speculative", &HookSet::add_speculative)
      .def("add_speculative_at", &HookSet::add_speculative_at)
      .def("add_speculative_branches_at",
           &HookSet::add_speculative_branches_at)
      .def("add_speculative_unify", &HookSet::add_speculative_unify)
      .def("add_planned", &HookSet::add_planned)
      .def("add_planned_events", &HookSet::add_planned_events)
      .def("clear", &HookSet::clear)
      .def("__len__", &HookSet::size);
  py::class_<PlannedTable>(m, "PlannedTable")
      .def(py::init<>())
      .def("set", &PlannedTable::set, py::arg("factors"),
           py::arg("checks") = std::vector<std::pair<double, double>>())
      .def("checked_by", &PlannedTable::checked_by)
      .def("use_python", &PlannedTable::use_python)
      .def_property_readonly("mode", &PlannedTable::mode)
      .def_property_readonly("deviated", &PlannedTable::deviated);
  py::class_<Speculation>(m, "Speculation")
      .def(py::init<py::handle, py::handle, double>())
      .def("use_python", &Speculation::use_python)
      .def("take_kept", &Speculation::take_kept)
      .def("hold", &Speculation::hold)
      .def("take_held", &Speculation::take_held)
      .def_property_readonly("mode", &Speculation::mode);
  py::class_<PlannedEvents>(m, "PlannedEvents")
      .def("__len__", [](const PlannedEvents& e) { return e.events.size(); });
  m.def("planned_events", &planned_events);
  m.def("divide_left_scaled", &divide_left_scaled);
  py::class_<Unit>(m, "UnitSet");
  py::class_<Landing>(m, "Landing")
      .def(py::init<>())
      .def_static("unit_set", &unit_set)
      .def_static("landing_set", &landing_set)
      .def_static("learn", &learn)
      .def("set_running", &Landing::set_running)
      .def("set_unit", &Landing::set_unit, py::arg("unit"),
           py::arg("record"), py::arg("pending") = py::none(),
           py::arg("excluded") = py::tuple())
      .def("hook", &landing_hook)
      .def_static("adopt", &adopt_landing)
      .def_static("adopted", &landing_adopted)
      .def_static("unadopt", &unadopt_landing);
  LandingHookType.tp_name = "gradient_scaling_native.LandingHook";
  LandingHookType.tp_basicsize = sizeof(LandingHook);
  LandingHookType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC;
  LandingHookType.tp_traverse = landing_traverse;
  LandingHookType.tp_clear = landing_clear;
  LandingHookType.tp_dealloc = landing_dealloc;
  LandingHookType.tp_call = landing_call;
  LandingHookType.tp_doc = "A parameter's landing hook (see Landing)";
  if (PyType_Ready(&LandingHookType) < 0) throw python_error();
  Py_INCREF(&LandingHookType);
  m.attr("LandingHook") = py::handle(
      reinterpret_cast<PyObject*>(&LandingHookType));
  m.def("structure", &structure);
  m.def("leaves_with_other_hooks", &leaves_with_other_hooks);
  m.def("leaf_devices", &leaf_devices);
  m.def("input_dtype", &input_dtype);
  m.def("finite_into", &finite_into);
  m.def("finite_all", &finite_all);
  m.def("unchecked_grads", &unchecked_grads);
  m.def("leaves_finite", &leaves_finite);
  m.def("half_gradients", &half_gradients);
  m.def("times_power_of_two", &times_power_of_two);
  m.def("max_abs", &max_abs);
  m.def("finite_witness", &finite_witness,
        py::call_guard<py::gil_scoped_release>());
  m.def("saved_finite_witnesses", &saved_finite_witnesses);
  m.def("small_spread_and_max", &small_spread_and_max,
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_model_scale", &gemm_model_scale,
        py::call_guard<py::gil_scoped_release>());
  m.def("log_moments", &log_moments,
        py::call_guard<py::gil_scoped_release>());
  py::class_<NodeOrder>(m, "NodeOrder")
      .def("__len__", [](const NodeOrder& o) { return o.list->size(); })
      .def("__getitem__", [](NodeOrder& o, Py_ssize_t i) {
        return o.list->object(o.list->checked(i));
      })
      .def("__getitem__", [](NodeOrder& o, py::slice slice) -> py::object {
        py::list all = all_objects(*o.list);
        return all[slice];
      })
      .def("__iter__", [](NodeOrder& o) {
        return py::iter(all_objects(*o.list));
      })
      .def("take", &take)
      .def("variables", &variables);
  py::class_<NodePositions>(m, "NodePositions")
      .def("__len__", [](const NodePositions& p) { return p.list->size(); })
      .def("__getitem__", [](const NodePositions& p, py::handle node) {
        Py_ssize_t i = p.list->position(node);
        if (i < 0) throw py::key_error(py::repr(node).cast<std::string>());
        return i;
      })
      .def("get", [](const NodePositions& p, py::handle node,
                     py::object otherwise) -> py::object {
        Py_ssize_t i = p.list->position(node);
        return i < 0 ? otherwise : py::int_(i);
      }, py::arg("node"), py::arg("default") = py::none())
      .def("__contains__", [](const NodePositions& p, py::handle node) {
        return p.list->position(node) >= 0;
      })
      .def("__iter__", [](NodePositions& p) {
        return py::iter(all_objects(*p.list));
      })
      .def("items", [](NodePositions& p) {
        py::list out(p.list->nodes.size());
        for (Py_ssize_t i = 0; i < p.list->size(); ++i) {
          out[i] = py::make_tuple(p.list->object(i), i);
        }
        return out;
      });
}
