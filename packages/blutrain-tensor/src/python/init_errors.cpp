// python/init_errors.cpp: our TypeError, naming the argument, where nanobind's overload
// resolution would answer a bad call with its generic "incompatible function arguments".
//
// Note [argument errors]
// nanobind converts each argument with a type caster; when one fails (a str for an int dim, an
// int past int64, a list for a Tensor, a missing or unknown argument) it raises a TypeError that
// lists the signature but names neither the op's convention ("[op] ...") nor the argument.  Each
// public function and Tensor method gets one more overload, (self?, *args, **kwargs), appended
// after its own: nanobind tries it only when the real one refused the call, so a valid call
// costs nothing.  It hands the call to blutrain.tensor._argerrors, which binds the arguments to
// the real overload's signature (__nb_signature__) and raises "[op] argument 'dim' must be int,
// got 'a' (str)" (or names the missing / unexpected / surplus argument).
// nanobind tries overloads twice, first without implicit conversions (an int for a float
// parameter is one): the catch-all takes a hidden keyword parameter whose caster refuses that
// first pass, so a call valid only with conversions still reaches the real overload in the second.
// The overloads are added when blutrain.tensor is imported (_install_argument_errors), after
// stubgen has read the module: the stubs show the real signatures only.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <iterator>
#include <string>
#include <utility>

#include "init.h"

namespace nb = nanobind;

namespace bt::python {
// The hidden parameter of the catch-all overloads: it converts only in nanobind's second pass.
struct SecondPass {};
}  // namespace bt::python

namespace nanobind::detail {
template <>
struct type_caster<bt::python::SecondPass> {
  NB_TYPE_CASTER(bt::python::SecondPass, const_name("object"))
  bool from_python(handle, uint32_t flags, cleanup_list*) noexcept {
    return (flags & static_cast<uint32_t>(cast_flags::convert)) != 0;
  }
  static handle from_cpp(bt::python::SecondPass, rv_policy, cleanup_list*) noexcept {
    return none().release();
  }
};
}  // namespace nanobind::detail

namespace bt::python {

namespace {

// Raises the TypeError of blutrain.tensor._argerrors for a refused call of scope.name.
[[noreturn]] void raise_argument_error(nb::handle scope, const std::string& name,
                                       const std::string& op, nb::handle self, nb::args args,
                                       nb::kwargs kwargs) {
  nb::object fn = nb::getattr(scope, name.c_str());
  nb::module_::import_("blutrain.tensor._argerrors").attr("raise_for")(op, fn, self, args, kwargs);
  throw TypeError("[" + op + "] invalid arguments");  // (raise_for always raises)
}

bool is_nb_function(nb::handle h, bool* method) {
  const std::string tn = nb::cast<std::string>(
      nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(h.ptr()))).attr("__name__"));
  *method = tn == "nb_method";
  return tn == "nb_func" || tn == "nb_method";
}

}  // namespace

void init_errors(nb::module_& m) {
  m.def(
      "_install_argument_errors",
      [](nb::handle scope) {
        nb::object names = nb::steal(PyObject_Dir(scope.ptr()));
        for (nb::handle n : names) {
          const std::string name = nb::cast<std::string>(n);
          // private helpers and Python's protocols are skipped, but for the dunders a user may
          // call by hand.  The binary operators' own overloads take any one operand (they raise
          // "[add] unsupported operand ..." themselves, never NotImplemented), so theirs only
          // ever sees a wrong count of arguments or a keyword: t.__add__(), t.__add__(a, b).
          static const char* const kDunders[] = {
              "__dlpack__",  "__dlpack_device__", "__len__", "__bool__",   "__getitem__",
              "__setitem__", "__neg__",           "__abs__", "__invert__", "__repr__"};
          static const std::pair<const char*, const char*> kBinary[] = {
              {"add", "add"},
              {"sub", "sub"},
              {"mul", "mul"},
              {"truediv", "div"},
              {"floordiv", "floor_divide"},
              {"mod", "remainder"},
              {"pow", "pow"},
              {"matmul", "matmul"},
              {"and", "logical_and"},
              {"or", "logical_or"},
              {"eq", "eq"},
              {"ne", "ne"},
              {"lt", "lt"},
              {"le", "le"},
              {"gt", "gt"},
              {"ge", "ge"}};
          const bool dunder =
              std::find(std::begin(kDunders), std::end(kDunders), name) != std::end(kDunders);
          std::string binary;  // the op of a binary operator dunder (__radd__, __iadd__: add)
          if (name.size() > 4 && name.rfind("__", 0) == 0 &&
              name.compare(name.size() - 2, 2, "__") == 0) {
            std::string core = name.substr(2, name.size() - 4);
            for (const auto& [py, nm] : kBinary) {
              if (core == py || ((core[0] == 'r' || core[0] == 'i') && core.substr(1) == py)) {
                binary = nm;
              }
            }
          }
          if (name.empty() || (name[0] == '_' && !dunder && binary.empty())) continue;
          // "[getitem] ...": the op a dunder implements
          const std::string op = !binary.empty() ? binary
                                 : dunder        ? name.substr(2, name.size() - 4)
                                                 : name;
          // (only this scope's own functions: a method inherited from a base is not re-chained)
          nb::object own = nb::steal(PyObject_GetAttr(scope.ptr(), n.ptr()));
          bool method = false;
          if (!own.is_valid()) {
            PyErr_Clear();
            continue;
          }
          if (!is_nb_function(own, &method)) continue;
          const std::string sig = "def " + name + "(" + (method ? "self, " : "") +
                                  "*args, **kwargs) -> typing.NoReturn";
          const char* doc = "Any other call: a TypeError naming the argument that is wrong.";
          if (method) {
            nb::cpp_function_def(
                [scope, name, op](nb::handle self, nb::args args, SecondPass, nb::kwargs kwargs) {
                  raise_argument_error(scope, name, op, self, args, kwargs);
                },
                nb::scope(scope), nb::name(name.c_str()), nb::is_method(), nb::arg("args"),
                nb::arg("_second_pass") = nb::none(), nb::arg("kwargs"), nb::sig(sig.c_str()), doc);
          } else {
            nb::cpp_function_def(
                [scope, name, op](nb::args args, SecondPass, nb::kwargs kwargs) {
                  raise_argument_error(scope, name, op, nb::none(), args, kwargs);
                },
                nb::scope(scope), nb::name(name.c_str()), nb::arg("args"),
                nb::arg("_second_pass") = nb::none(), nb::arg("kwargs"), nb::sig(sig.c_str()), doc);
          }
        }
      },
      nb::arg("scope"),
      "Adds the catch-all overloads of Note [argument errors] to scope's public functions.");
}

}  // namespace bt::python
