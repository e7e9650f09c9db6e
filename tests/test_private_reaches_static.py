"""Every reach into another library's internals is registered: a static check of the source.

The package's modules are parsed (no framework is imported, so this runs everywhere) and three
kinds of reach are found:

* an import from ``keras.src``, ``tensorflow.python`` or ``jax._src``;
* a private attribute (one leading underscore, not a dunder) read or set on something that is
  not the package's own, also by name (``getattr``/``hasattr``/``setattr`` with a constant);
* a patch of a public attribute of something that is not the package's own: ``X.attr = ...``
  onto a class (a name spelt with a capital, ``nn.SyncBatchNorm``), ``x.attr = f`` or
  ``setattr(x, "attr", f)`` with ``f`` a lambda, a function of the module or a made method,
  and any ``object.__setattr__(x, ...)``, ``vars(x)[...] = ...`` or ``x.__dict__[...] = ...``
  (past the object's own ``__setattr__``). Setting a public attribute to a value
  (``p.grad = g``) is the libraries' public interface, not a reach.

What counts as the package's own, by the expression the attribute is taken on: ``self`` and
``cls``; a private attribute of those (``self._loop``: an object the package keeps); a name
imported from ``gradient_accumulator`` or a class or function defined in the same module;
``super()``; and a literal. Everything else is foreign. The rule is syntactic, so it errs both
ways: an inherited private method of a foreign base class called on ``self``
(``self._moments``) is not seen (those are registered by hand), and a local variable that
holds the package's own object (``opt._retrace_if_changed`` on a GradientAccumulateOptimizer)
is flagged.

Each finding, as (module, attribute or imported module), must be in :data:`ALLOWED`, which maps
it either to a registered reach (a prefix of one ``Reach`` target, in the ``REACHES`` of
``_reaches.py`` or a glue module, that names the attribute) or to ``"not a reach: <why>"``
(the package's own object, or a public interface the rule misreads). A patch must map to a
``patch:`` reach. A new reach fails :func:`test_every_reach_is_registered` until it is added
to a glue module's ``REACHES`` (with a probe) and here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gradient_accumulator"
FOREIGN_IMPORTS = ("keras.src", "tensorflow.python", "jax._src")
# The modules whose REACHES tuples are the registry.
REGISTRIES = (
    "_reaches.py",
    "keras/_compat.py",
    "torch/_glue.py",
    "torch/_proxy.py",
    "torch/accelerate.py",
    "torch/transformers.py",
)

ALLOWED: dict[tuple[str, str], str] = {
    # the interpreter
    ("nonfinite.py", "_getframe"): "frame: sys._getframe",
    ("keras/_compat.py", "_getframe"): "frame: sys._getframe",
    # Keras, TensorFlow (keras/_compat.py's REACHES)
    ("keras/_compat.py", "_backend_apply_gradients"): "keras.optimizers.Optimizer.apply = ",
    ("keras/_compat.py", "_filter_empty_gradients"): "keras.optimizers.Optimizer.apply = ",
    ("keras/_compat.py", "_overwrite_variables_directly_with_gradients"): (
        "keras.optimizers.Optimizer.apply = "
    ),
    ("keras/_compat.py", "tensorflow.python.ops.control_flow_switch_case"): (
        "tensorflow.python.ops.control_flow_switch_case"
    ),
    ("keras/optimizer.py", "keras.src.utils.tracking"): "keras.src.utils.tracking",
    ("keras/_core_path.py", "_use_weight_decay"): "keras.optimizers.Optimizer(): ",
    ("keras/_packed.py", "_iterations"): "keras.optimizers.Optimizer(): ",
    ("keras/callbacks.py", "_flatten_layers"): "keras.Model()._flatten_layers",
    ("keras/layers.py", "_flatten_layers"): "keras.Model()._flatten_layers",
    ("keras/callbacks.py", "_jax_state"): "keras.Model()._jax_state",
    ("keras/_replica_shell.py", "tensorflow.python.distribute"): "tensorflow.python.distribute",
    ("keras/_tf_shell.py", "tensorflow.python.ops.control_flow_v2_func_graphs"): (
        "tensorflow.python.ops.control_flow_v2_func_graphs"
    ),
    ("keras/_replica_shell.py", "_all_reduce_sum_gradients"): (
        "patch: keras.optimizers.Optimizer()"
    ),
    ("keras/_loss_scale.py", "<dynamic>"): "patch: keras.optimizers.LossScaleOptimizer()",
    ("keras/callbacks.py", "train_step"): "patch: keras.Model().train_step",
    ("keras/callbacks.py", "train_function"): "patch: keras.Model().train_step",
    ("keras/callbacks.py", "_plain_train_step"): "patch: keras.Model().train_step",
    ("keras/callbacks.py", "_weighs_batches"): "patch: keras.Model().train_step",
    ("keras/callbacks.py", "_batch_weight_unit"): "patch: keras.Model().train_step",
    ("keras/_shell.py", "_layout"): "keras.Variable()._layout",
    ("keras/_packed.py", "_layout"): "keras.Variable()._layout",
    ("keras/layers.py", "_layout"): "keras.Variable()._layout",
    # torch (torch/_glue.py's REACHES)
    ("keras/_core_path.py", "_version"): "torch.Tensor()._version",
    ("torch/_update.py", "_foreach_add_"): "torch._foreach_add_",
    ("torch/_update.py", "_global_optimizer_pre_hooks"): "torch.optim.optimizer._global",
    ("torch/_update.py", "_global_optimizer_post_hooks"): "torch.optim.optimizer._global",
    ("torch/_update.py", "_opt_called"): "torch.optim.Optimizer()._opt_called",
    ("torch/_update.py", "_optimizer_step_pre_hooks"): "torch.optim.Optimizer()._optimizer_step",
    ("torch/_update.py", "_optimizer_step_post_hooks"): ("torch.optim.Optimizer()._optimizer_step"),
    ("torch/_update.py", "_scale"): "torch.amp.GradScaler()._scale",
    ("torch/batchnorm.py", "_buffers"): "torch.nn.Module()._buffers",
    ("torch/batchnorm.py", "_BatchNorm"): "torch.nn.modules.batchnorm._BatchNorm",
    ("torch/_glue.py", "convert_sync_batchnorm"): "patch: torch.nn.SyncBatchNorm",
    ("torch/fsdp.py", "_get_fsdp_state"): "torch.distributed.fsdp.FSDPModule()",
    ("torch/fsdp.py", "_fsdp_param_groups"): "torch.distributed.fsdp.FSDPModule()",
    ("torch/fsdp.py", "_unsharded_param"): "torch.distributed.fsdp FSDPParam()",
    ("torch/fsdp.py", "_local_tensor"): "torch.distributed.tensor.DTensor()._local_tensor",
    ("torch/fsdp.py", "_flatten"): "torch.distributed.device_mesh.DeviceMesh()._flatten",
    # accelerate (torch/accelerate.py's REACHES)
    ("torch/_guards.py", "_shared_state"): "accelerate.state.GradientState._shared_state",
    # Found by the rule, but the package's own objects or public API:
    ("keras/_jax_shell.py", "_asdict"): "not a reach: a NamedTuple's public method",
    ("keras/_jax_shell.py", "_fields"): "not a reach: a NamedTuple's public attribute",
    ("keras/_tf_shell.py", "_fields"): "not a reach: a NamedTuple's public attribute",
    ("keras/_loss_scale.py", "_use_loss_scaling"): "not a reach: the package's optimizer wrapper's",
    ("keras/_loss_scale.py", "_zero_between_cycles"): (
        "not a reach: the LossScaleOptimizer's inner optimizer is the package's own wrapper"
    ),
    ("keras/_packed.py", "_accumulators"): "not a reach: the package's optimizer wrapper's",
    ("keras/_packed.py", "_seen"): "not a reach: the package's optimizer wrapper's",
    ("keras/callbacks.py", "_cycle_counters"): "not a reach: the package's optimizer wrapper's",
    ("keras/callbacks.py", "_retrace_if_changed"): (
        "not a reach: the package's optimizer wrapper's"
    ),
    ("keras/callbacks.py", "_set_epoch_clock"): "not a reach: the package's optimizer wrapper's",
    ("keras/callbacks.py", "_step_weight"): (
        "not a reach: set on the package's optimizer wrapper (opt.__dict__)"
    ),
    ("keras/layers.py", "_accumulator"): "not a reach: AccumBatchNormalization's own",
    ("keras/layers.py", "_reset_accum"): "not a reach: AccumBatchNormalization's own",
    ("keras/model.py", "_use_loss_scaling"): "not a reach: the package's optimizer wrapper's",
    ("keras/optimizer.py", "learning_rate"): (
        "not a reach: the inner optimizer's public learning_rate, set to a value (the name is "
        "also a function of the module)"
    ),
    ("torch/_glue.py", "_keeps_layers"): "not a reach: an attribute of the package's own patch",
    ("keras/_compat.py", "_fit_hook"): "not a reach: an attribute of the package's own patch",
    ("torch/_options.py", "_loop"): "not a reach: the package's optimizer wrapper's",
    ("torch/fused.py", "_loop"): "not a reach: the package's optimizer wrapper's",
    ("torch/fused.py", "_ga_key"): "not a reach: FusedLinear's own",
    ("torch/fused.py", "_originals"): "not a reach: FusionReport's own",
    ("torch/batchnorm.py", "_accum_steps"): "not a reach: AccumBatchNorm's own",
    ("torch/batchnorm.py", "_ga_owner"): "not a reach: AccumBatchNorm's own",
    ("torch/batchnorm.py", "_loop"): "not a reach: the package's optimizer wrapper's",
    ("torch/batchnorm.py", "_multi_rank"): "not a reach: AccumBatchNorm's own",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_names(tree: ast.Module) -> set[str]:
    """Names bound in the module to the package's own objects: imports from
    gradient_accumulator and the module's top-level (and nested) classes and functions."""
    own = {"self", "cls"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "gradient_accumulator"
        ):
            own.update((a.asname or a.name) for a in node.names)
        elif isinstance(node, ast.Import):
            own.update(
                (a.asname or a.name.split(".")[0])
                for a in node.names
                if a.name.startswith("gradient_accumulator")
            )
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            own.add(node.name)
    return own


def _is_own(base: ast.expr, own: set[str]) -> bool:
    if isinstance(base, ast.Name):
        return base.id in own
    if isinstance(base, ast.Attribute):  # self._loop: an object the package keeps
        return _private(base.attr) and isinstance(base.value, ast.Name) and base.value.id in own
    if isinstance(base, ast.Call) and isinstance(base.func, ast.Name):
        return base.func.id == "super"  # the class's own methods, through its bases
    return isinstance(base, ast.Constant)


def _is_class(base: ast.expr) -> bool:
    """A class by its spelling: ``SyncBatchNorm``, ``nn.SyncBatchNorm``, ``keras.Model``."""
    name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
    return name[:1].isupper()


def _is_function(value: ast.expr, functions: set[str]) -> bool:
    """A value that patches a method: a lambda, a function of the module, a bound method or a
    class/static method made here."""
    if isinstance(value, ast.Lambda):
        return True
    if isinstance(value, ast.Name):
        return value.id in functions
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        return name in ("MethodType", "classmethod", "staticmethod", "partial")
    return False


def find_reaches(source: str) -> list[tuple[str, str]]:
    """The reaches in ``source``: (kind, name) with kind ``"import"``, ``"private"`` or
    ``"assign"`` (a public attribute patched onto a foreign class or instance)."""
    tree = ast.parse(source)
    own = _own_names(tree)
    functions = {
        n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    found: list[tuple[str, str]] = []

    def foreign_import(module: str) -> bool:
        return any(module == p or module.startswith(p + ".") for p in FOREIGN_IMPORTS)

    def patched(base: ast.expr, key: ast.expr) -> None:
        # object.__setattr__(x, ...), vars(x)[...] = ..., x.__dict__[...] = ...: past x's own
        # __setattr__, an instance patch.
        if _is_own(base, own):
            return
        name = key.value if isinstance(key, ast.Constant) else "<dynamic>"
        found.append(("private" if _private(str(name)) else "assign", str(name)))

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and foreign_import(node.module or ""):
            found.append(("import", node.module or ""))
        elif isinstance(node, ast.Import):
            found.extend(("import", a.name) for a in node.names if foreign_import(a.name))
        elif isinstance(node, ast.Attribute):
            if _private(node.attr) and not _is_own(node.value, own):
                found.append(("private", node.attr))
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Attribute)
                    and not _private(target.attr)
                    and not _is_own(target.value, own)
                    and (_is_class(target.value) or _is_function(node.value, functions))
                ):
                    found.append(("assign", target.attr))
                elif isinstance(target, ast.Subscript):
                    holder = target.value
                    if (
                        isinstance(holder, ast.Call)
                        and isinstance(holder.func, ast.Name)
                        and holder.func.id == "vars"
                        and holder.args
                    ):
                        patched(holder.args[0], target.slice)
                    elif isinstance(holder, ast.Attribute) and holder.attr == "__dict__":
                        patched(holder.value, target.slice)
        elif isinstance(node, ast.Call):
            func, args = node.func, node.args
            if (
                len(args) >= 2
                and isinstance(func, ast.Name)
                and func.id in ("getattr", "hasattr")
                and isinstance(args[1], ast.Constant)
                and _private(str(args[1].value))
                and not _is_own(args[0], own)
            ):
                found.append(("private", str(args[1].value)))
            if (
                len(args) >= 2
                and isinstance(func, ast.Attribute)
                and func.attr == "__setattr__"
                and isinstance(func.value, ast.Name)
                and func.value.id == "object"
            ):
                patched(args[0], args[1])
            elif (
                len(args) >= 3
                and isinstance(func, ast.Name)
                and func.id == "setattr"
                and (_is_class(args[0]) or _is_function(args[2], functions))
                and not _is_own(args[0], own)
            ):
                name = args[1].value if isinstance(args[1], ast.Constant) else "<dynamic>"
                found.append(("assign", str(name)))
    return found


def _registered_targets() -> list[str]:
    """Every Reach target of the registry modules, read from their source."""
    targets = []
    for rel in REGISTRIES:
        tree = ast.parse((PACKAGE / rel).read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "Reach"
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
            ):
                targets.append(node.args[1].value)
    return targets


def _package_findings() -> dict[tuple[str, str], set[str]]:
    findings: dict[tuple[str, str], set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for kind, name in find_reaches(path.read_text()):
            findings.setdefault((rel, name), set()).add(kind)
    return findings


def test_every_reach_is_registered():
    findings = _package_findings()
    missing = sorted(
        f"{m}: {k} {n}"
        for (m, n), kinds in findings.items()
        for k in kinds
        if (m, n) not in ALLOWED
    )
    assert not missing, "unregistered reaches into other libraries:\n" + "\n".join(missing)


def test_the_allowed_reaches_are_in_the_registry():
    targets = _registered_targets()
    findings = _package_findings()
    problems = []
    for (module, name), where in ALLOWED.items():
        if (module, name) not in findings:
            problems.append(f"{module}: {name} is allowed but no longer found")
            continue
        if where.startswith("not a reach: "):
            continue
        matches = [t for t in targets if t.startswith(where)]
        if len(matches) != 1:
            problems.append(f"{module}: {name} -> {where!r} matches {len(matches)} reaches")
            continue
        (target,) = matches
        if name != "<dynamic>" and name not in target and "hook dicts" not in target:
            problems.append(f"{module}: {name}: the reach {target!r} does not name it")
        if "assign" in findings[(module, name)] and not target.startswith("patch:"):
            problems.append(f"{module}: {name} is assigned, but {target!r} is not a patch")
    assert not problems, "\n".join(problems)


PLANTED = """
from keras.src.utils import tracking
import tensorflow.python.ops
from gradient_accumulator.keras import _packed

def f(model, opt):
    opt._secret_state += 1          # a private attribute of a foreign object
    _packed._locate(model)          # the package's own module: fine
    keras.Model.fit = lambda *a: 0  # a patch of a foreign class
    setattr(model, "train_step", lambda *a: None)
    getattr(model, "_hidden", None)  # a private attribute read by name
    vars(opt)["apply"] = None

class Mine:
    def g(self):
        return self._own, Mine._x  # the package's own
"""


def test_a_planted_reach_is_reported():
    found = find_reaches(PLANTED)
    assert ("import", "keras.src.utils") in found
    assert ("import", "tensorflow.python.ops") in found
    assert ("private", "_secret_state") in found
    assert ("private", "_hidden") in found
    assert ("assign", "fit") in found
    assert ("assign", "train_step") in found
    assert ("assign", "apply") in found
    assert not any(name in ("_locate", "_own", "_x") for _, name in found), found
    assert len(found) == 7, found
