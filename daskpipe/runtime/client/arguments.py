"""Up-front checks of the arguments of ``deploy`` and ``deploy_hybrid``.

A wrong argument fails at once with a :class:`~daskpipe.runtime.errors.DeployError` that names
it, before anything is profiled, scattered or started, rather than as whatever breaks first
deep inside ("can't multiply sequence by non-int", "'function' object has no attribute 'eval'",
or a negative SLO reported in microseconds by a worker).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import torch
from torch import nn

from daskpipe.plan.options import PlannerOptions
from daskpipe.plan.schema import Plan
from daskpipe.profiles.model import Profile
from daskpipe.runtime.client.pools import SharedPools
from daskpipe.runtime.deploying.profiling import ProfilingOptions
from daskpipe.runtime.errors import DeployError, check_count, check_positive
from daskpipe.runtime.scheduler.elastic.state import ElasticSettings
from daskpipe.sched.registry import MULTIPLEXING


def check_module(what: str, value: Any) -> None:
    """``value`` is a ``torch.nn.Module`` (what gets traced, cut into blocks and served)."""
    if not isinstance(value, nn.Module):
        hint = "; wrap it in an nn.Module whose forward calls it" if callable(value) else ""
        raise DeployError(f"{what} must be a torch.nn.Module, got {type(value).__name__}{hint}")


def check_example(what: str, value: Any) -> None:
    """``value`` is a dense, batched tensor with values, or a tuple (positional arguments) or dict
    (keyword arguments) of them: it fixes the form, shapes and dtypes requests must have."""
    if isinstance(value, tuple) and value:
        for index, item in enumerate(value):
            check_example(f"{what}[{index}]", item)
        return
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            check_example(f"{what}[{key!r}]", item)
        return
    problem = None
    if not isinstance(value, torch.Tensor):
        problem = type(value).__name__
    elif value.is_nested:
        problem = "a nested tensor"
    elif value.layout is not torch.strided:
        problem = f"a tensor of layout {value.layout}"
    elif value.device.type == "meta":
        problem = "a meta tensor (it holds no values)"
    elif value.dim() < 1 or value.shape[0] < 1:
        problem = f"a tensor of shape {tuple(value.shape)}"
    if problem is not None:
        raise DeployError(f"{what} must be a dense batched torch.Tensor with values, e.g. torch.randn(1, 3, 224, 224), got {problem}")


def check_mapping(what: str, value: Any, names: list[str] | None, check: Callable[[str, Any], None]) -> None:
    """``value`` maps names (all among ``names``, when given) to values ``check`` accepts."""
    if not isinstance(value, Mapping):
        raise DeployError(f"{what} must map model names to values, got {type(value).__name__}")
    for name, item in value.items():
        if names is not None and name not in names:
            raise DeployError(f"{what} names {name!r}, which is not a deployed model; deployed: {names}")
        check(f"{what}[{name!r}]", item)


def check_deploy_arguments(
    models: Any,
    example_inputs: Any,
    *,
    slo_ms: Any,
    weights: Any,
    time_dilation: Any,
    planner: Any,
    profiling: Any,
    dispatcher: Any,
    allow_nonfinite: Any,
    plan: Any,
    profiles: Any,
    max_queued: Any,
    elastic: Any,
    pools: Any = None,
) -> None:
    """``deploy``'s arguments, each checked for its type and range; the first wrong one fails, named."""
    if not isinstance(models, Mapping):
        raise DeployError(f"models must map model names to torch.nn.Module, e.g. {{'resnet': model}}, got {type(models).__name__}")
    if not models:
        raise DeployError("deploy needs at least one model")
    bad_names = [name for name in models if not isinstance(name, str) or not name]
    if bad_names:
        raise DeployError(f"model names must be non-empty strings, got {bad_names!r}")
    names = list(models)
    for name, module in models.items():
        check_module(f"models[{name!r}]", module)
    if not isinstance(example_inputs, Mapping):
        raise DeployError(f"example_inputs must map each model name to a batched example tensor, got {type(example_inputs).__name__}")
    missing = [m for m in names if m not in example_inputs]
    if missing:
        raise DeployError(f"example_inputs lacks {missing}; give a batched example tensor per model")
    for name in names:
        check_example(f"example_inputs[{name!r}]", example_inputs[name])
    if slo_ms is not None:
        check_mapping("slo_ms", slo_ms, names, lambda what, value: check_positive(what, value, " ms"))
    if weights is not None:
        check_mapping("weights", weights, names, check_positive)
    check_positive("time_dilation", time_dilation)
    for what, value, kind in (("planner", planner, PlannerOptions), ("profiling", profiling, ProfilingOptions)):
        if not isinstance(value, kind):
            raise DeployError(f"{what} must be a {kind.__name__}, e.g. {kind.__name__}(), got {type(value).__name__}")
    if not isinstance(dispatcher, str):
        raise DeployError(f"dispatcher must be a name (str), got {dispatcher!r}")
    if not isinstance(allow_nonfinite, bool):
        raise DeployError(f"allow_nonfinite must be True or False, got {allow_nonfinite!r}")
    if plan is not None and not isinstance(plan, (Plan, str, os.PathLike)):
        raise DeployError(f"plan must be a Plan or the path of a plan.json, got {type(plan).__name__}")
    if profiles is not None:
        check_mapping("profiles", profiles, None, check_profile)
    if max_queued is not None:
        check_count("max_queued (None for the default)", max_queued)
    if elastic is not None and not isinstance(elastic, ElasticSettings):
        raise DeployError(f"elastic must be an ElasticSettings or None, got {type(elastic).__name__}")
    if pools is not None:
        if not isinstance(pools, SharedPools):
            raise DeployError(f"pools must be a SharedPools or None (PPipe's planned pools), got {type(pools).__name__}")
        if dispatcher not in MULTIPLEXING:
            raise DeployError(
                f"a shared pool needs a data plane that shares slots between models ({', '.join(MULTIPLEXING)}), got {dispatcher!r}"
            )
        if plan is not None:
            raise DeployError("pools=SharedPools() makes its own plan (every model on every slot of its sub-cluster); pass no plan=")


def check_profile(what: str, value: Any) -> None:
    """``value`` is a :class:`Profile` (``Profile.load`` reads one from a file)."""
    if not isinstance(value, Profile):
        raise DeployError(f"{what} must be a daskpipe Profile (Profile.load reads a profile file), got {type(value).__name__}")


def check_model_change(
    name: Any, module: Any, example: Any, *, slo_ms: Any, profile: Any, weight: Any, max_queued: Any, profiling: Any
) -> None:
    """The arguments of ``Service.add_model`` and ``update_model``, checked as ``deploy`` checks its own."""
    if not isinstance(name, str) or not name:
        raise DeployError(f"a model name must be a non-empty string, got {name!r}")
    check_module(f"the module of {name!r}", module)
    if example is not None:
        check_example(f"the example input of {name!r}", example)
    if slo_ms is not None:
        check_positive(f"slo_ms of {name!r}", slo_ms, " ms")
    if profile is not None:
        check_profile(f"the profile of {name!r}", profile)
    check_positive(f"the weight of {name!r}", weight)
    if max_queued is not None:
        check_count("max_queued (None for the default)", max_queued)
    if not isinstance(profiling, ProfilingOptions):
        raise DeployError(f"profiling must be a ProfilingOptions, e.g. ProfilingOptions(), got {type(profiling).__name__}")
