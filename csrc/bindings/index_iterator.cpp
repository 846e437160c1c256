// fastddp._C.IndexIterator: the iterator DistributedSampler.__iter__ returns.
//
// torch's sampler returns iter(list): one C-level next() per index, a length hint, and pickling
// (a list iterator pickles as the list and its position). This type behaves the same over an
// int64 tensor, without building the list: next() boxes one element, __length_hint__ is what
// is left, and __reduce__ gives iter(list of what is left), so an unpickled or copied iterator
// is a list iterator that yields the same values. `position` (read-only) is the index of the
// next element in the tensor, which the sampler reports as its resume point.
//
// A plain CPython type rather than a pybind11 class: pybind11's dispatch would cost more per
// next() than the whole of a list iterator's.
#include "bindings/index_iterator.h"

#include <new>

namespace py = pybind11;

namespace fastddp::bindings {
namespace {

struct IndexIterator {
  PyObject_HEAD
  at::Tensor indices;  // 1-D int64 CPU, contiguous; released once exhausted
  const int64_t* data;
  int64_t position;
  int64_t end;
};

void release(IndexIterator* it) {
  it->indices = at::Tensor();
  it->data = nullptr;
  it->position = it->end;
}

void index_iterator_dealloc(PyObject* self) {
  auto* it = reinterpret_cast<IndexIterator*>(self);
  PyTypeObject* type = Py_TYPE(self);
  it->indices.~Tensor();
  type->tp_free(self);
  Py_DECREF(type);  // instances of a heap type hold a reference to it
}

PyObject* index_iterator_next(PyObject* self) {
  auto* it = reinterpret_cast<IndexIterator*>(self);
  if (it->position < it->end) return PyLong_FromLongLong(it->data[it->position++]);
  if (it->data != nullptr) release(it);  // as a list iterator drops its list at the end
  return nullptr;  // no exception set: StopIteration
}

PyObject* index_iterator_length_hint(PyObject* self, PyObject* /*unused*/) {
  auto* it = reinterpret_cast<IndexIterator*>(self);
  return PyLong_FromLongLong(it->end - it->position);
}

PyObject* index_iterator_reduce(PyObject* self, PyObject* /*unused*/) {
  auto* it = reinterpret_cast<IndexIterator*>(self);
  PyObject* rest = PyList_New(it->end - it->position);
  if (rest == nullptr) return nullptr;
  for (int64_t i = it->position; i < it->end; ++i) {
    PyObject* value = PyLong_FromLongLong(it->data[i]);
    if (value == nullptr) {
      Py_DECREF(rest);
      return nullptr;
    }
    PyList_SET_ITEM(rest, i - it->position, value);
  }
  PyObject* iter = PyDict_GetItemString(PyEval_GetBuiltins(), "iter");  // borrowed
  return Py_BuildValue("O(N)", iter, rest);
}

PyObject* index_iterator_new(PyTypeObject* /*type*/, PyObject* /*args*/, PyObject* /*kwargs*/) {
  PyErr_SetString(PyExc_TypeError,
                  "cannot create 'fastddp._C.IndexIterator' instances; iterate a DistributedSampler");
  return nullptr;
}

PyObject* index_iterator_position(PyObject* self, void* /*closure*/) {
  return PyLong_FromLongLong(reinterpret_cast<IndexIterator*>(self)->position);
}

PyMethodDef index_iterator_methods[] = {
    {"__length_hint__", index_iterator_length_hint, METH_NOARGS, "Indices left."},
    {"__reduce__", index_iterator_reduce, METH_NOARGS, "iter(list of the indices left)."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef index_iterator_getset[] = {
    {"position", index_iterator_position, nullptr, "Index of the next element.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyType_Slot index_iterator_slots[] = {
    {Py_tp_new, reinterpret_cast<void*>(index_iterator_new)},
    {Py_tp_dealloc, reinterpret_cast<void*>(index_iterator_dealloc)},
    {Py_tp_iter, reinterpret_cast<void*>(PyObject_SelfIter)},
    {Py_tp_iternext, reinterpret_cast<void*>(index_iterator_next)},
    {Py_tp_methods, index_iterator_methods},
    {Py_tp_getset, index_iterator_getset},
    {Py_tp_doc, const_cast<char*>("Iterator over an int64 index tensor (see DistributedSampler).")},
    {0, nullptr}};

PyType_Spec index_iterator_spec = {"fastddp._C.IndexIterator", sizeof(IndexIterator), 0,
                                   Py_TPFLAGS_DEFAULT,
                                   index_iterator_slots};

}  // namespace

void add_index_iterator(py::module_& m) {
  auto type = py::reinterpret_steal<py::object>(PyType_FromSpec(&index_iterator_spec));
  if (!type) throw py::error_already_set();
  m.add_object("IndexIterator", type);
  m.def(
      "index_iterator",
      [type](const at::Tensor& indices, int64_t start) {
        TORCH_CHECK(indices.dim() == 1 && indices.scalar_type() == at::kLong &&
                        indices.device().is_cpu() && indices.is_contiguous(),
                    "index_iterator: indices must be a contiguous 1-D int64 CPU tensor, got ",
                    indices.sizes(), " ", indices.scalar_type(), " on ", indices.device());
        TORCH_CHECK(start >= 0 && start <= indices.numel(), "index_iterator: start ", start,
                    " outside [0, ", indices.numel(), "]");
        auto* tp = reinterpret_cast<PyTypeObject*>(type.ptr());
        PyObject* obj = tp->tp_alloc(tp, 0);
        if (obj == nullptr) throw py::error_already_set();
        auto* it = reinterpret_cast<IndexIterator*>(obj);
        new (&it->indices) at::Tensor(indices);
        it->data = indices.data_ptr<int64_t>();
        it->position = start;
        it->end = indices.numel();
        return py::reinterpret_steal<py::object>(obj);
      },
      py::arg("indices"), py::arg("start"),
      "An IndexIterator over indices[start:] (holds a reference to the tensor).");
}

}  // namespace fastddp::bindings
