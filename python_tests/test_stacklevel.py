"""callers_stacklevel: a warning points at the user's line past flashhead_ext, torch, transformers
and accelerate frames (whole top-level package names only), at whatever depth it is reached."""
import warnings

from flashhead_ext._stacklevel import callers_stacklevel


def _warn():
    warnings.warn("from the library", UserWarning, stacklevel=callers_stacklevel())


def _pass_through(module: str, inner):
    """A function whose frames belong to ``module`` (its globals' __name__), calling ``inner``."""
    namespace = {"__name__": module, "inner": inner}
    exec(compile("def call():\n    return inner()\n", f"<{module}>", "exec"), namespace)
    return namespace["call"]


def _caught(call):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        call()
    assert len(record) == 1
    return record[0]


def test_a_warning_points_past_the_packages_between_the_user_and_the_library():
    call = _warn
    for module in ("flashhead_ext.head", "torch.nn.modules.module", "transformers.models.llama.modeling_llama",
                   "accelerate.hooks", "torch._dynamo.eval_frame", "flashhead_ext"):
        call = _pass_through(module, call)
        warned = _caught(call)  # through each depth of wrappers: _caught's call() line
        assert (warned.filename, warned.lineno) == (__file__, _caught.__code__.co_firstlineno + 3)


def test_a_user_module_whose_name_only_starts_like_those_packages_is_the_users():
    for module in ("torchapp", "transformers_demo.main", "accelerated", "flashhead_ext_scripts.run"):
        user = _pass_through(module, _warn)
        warned = _caught(_pass_through("torch.nn.modules.module", user))
        assert warned.filename == f"<{module}>", module
