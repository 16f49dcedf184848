"""The user's own layer: a module class or factory that replaces the attention, the dense MLP or
the whole decoder layer of every layer a rank builds (``replace=`` of ``modeling.build_model``,
``modeling.parallel.build_rank`` and ``tracemem.estimate``; the CLI's ``--replace
attn=mypkg.mod:MyAttention``).

Calling convention (docs/modified-architectures.md walks through an example):

- ``factory(ctx)`` is called once per layer the rank holds (the MTP modules' layers included),
  on the device being built (``torch.device`` context: meta for an estimate), with a
  ``LayerContext``; it returns an ``nn.Module``. A class whose ``__init__`` takes ``ctx`` is a
  factory. Parameters are cast to the run's dtype after building (bf16 in an estimate); make
  them float (``torch.empty``) and let the cast set the dtype.
- ``attn``: ``forward(x)``; ``x`` and the result are this rank's tokens ``(b, s / (cp * sp),
  h)``. The module runs its own collectives (``modeling.parallel.collectives.all_gather`` of
  the sequence over ``ctx.sizes.sp`` before column-parallel projections,
  ``reduce_scatter`` after the row-parallel output projection; ``all_gather`` of K / V over
  ``ctx.sizes.cp``), as Megatron-Core's attention does. Heads held: ``ctx.sizes.num_heads``.
  Under ``--recompute selective`` the layer sets ``module.recompute`` to the selected names
  among "core_attn" and "mla_up_proj" (a frozenset); the module may honour it (as
  ``MLA`` does with ``torch.utils.checkpoint``) or ignore it.
- ``mlp``: the dense FFN of the layers that are not MoE; ``forward(x)``, shapes as ``attn``;
  width held ``ctx.sizes.dense_inter`` (TP-split); ``reduce_scatter`` / ``all_gather`` over
  ``ctx.sizes.sp`` as ``attn``.
- ``block``: the whole decoder layer; ``forward(x, routing)``, shapes as ``attn``;
  ``routing`` is the ``modeling.routing`` model that an MoE asks for per-expert token counts.
  Recompute: "full" checkpoints the whole layer (``CustomBlock``); "selective" is refused.

Every parameter the module makes declares its group where it is made
(``modeling.parallel.groups.declare``): dense or expert, the dimension TP / ETP splits, EP;
static memory, ZeRO and counts read it. The module must be shape-static on meta: an op that
needs values raises ``tracemem.errors.DataDependentOpError``, an op without a meta kernel
``MissingMetaKernelError`` with the ``torch.library.register_fake`` stub.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tracemem.errors import TracememError

__all__ = ["REPLACEABLE", "LayerContext", "Replacements", "resolve_replacements",
           "CustomBlock"]

# what --replace can replace, and what the module's forward takes
REPLACEABLE = {
    "attn": "the attention: forward(x) -> (b, s_local, h)",
    "mlp": "the dense FFN of non-MoE layers: forward(x) -> (b, s_local, h)",
    "block": "the whole decoder layer: forward(x, routing) -> (b, s_local, h)",
}
_SPEC = re.compile(r"^(?P<target>[^:]+):(?P<name>[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_]"
                   r"[A-Za-z0-9_]*)*)$")


@dataclass(frozen=True)
class LayerContext:
    """What a replacement factory receives.

    Attributes:
        cfg: the model config (``hidden_size``, ``num_attention_heads``, ...).
        layer_id: the global layer number (0-based; MTP depth k is ``num_layers + k - 1``).
        sizes: this rank's local sizes (``modeling.parallel.plans.LocalSizes``: heads held
            ``num_heads``, widths held, and the degrees ``tp``, ``sp`` (tp with SP, else 1),
            ``cp``, ``ep``, ``etp``).
        kernels: the kernel profile (``modeling.kernels.KernelProfile``; ``kernels.name``).
        attention: the attention kernel asked for ("flash" or "eager").
        moe: whether this layer's FFN is an MoE (``cfg.is_moe_layer(layer_id)``).
        rank: this rank's coordinates (``modeling.parallel.build.RankCoordinates``: tp_rank,
            cp_rank, dp_rank, ep_rank, ...) under ``build_rank``; None under ``build_model``.
    """

    cfg: object
    layer_id: int
    sizes: object
    kernels: object
    attention: str
    moe: bool
    rank: object = None


Replacements = dict[str, Callable[[LayerContext], nn.Module]]


def _load(target: str, spec: str):
    """The module named by ``target``: a dotted module name, or a ``.py`` file path."""
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            raise TracememError(f"--replace {spec!r}: no file {target}")
        for module in list(sys.modules.values()):  # imported already (by name or path):
            file = getattr(module, "__file__", None)  # once per process, its torch.library
            if file and Path(file).resolve() == path:  # ops too
                return module
        name = "tracemem_replace_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
        loader = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[name] = module
        try:
            loader.loader.exec_module(module)
        except (Exception, SystemExit) as error:  # SystemExit: a script's exit() on import
            del sys.modules[name]
            raise TracememError(f"--replace {spec!r}: importing {target} failed: "
                                f"{type(error).__name__}: {error}".splitlines()[0]) from error
        return module
    try:
        return importlib.import_module(target)
    except ImportError as error:
        raise TracememError(f"--replace {spec!r}: cannot import module {target!r} "
                            f"({error}); give pkg.module:Name with pkg on PYTHONPATH, or "
                            f"path/to/file.py:Name".splitlines()[0]) from error


def _resolve_one(kind: str, value, spec: str) -> Callable[[LayerContext], nn.Module]:
    if kind not in REPLACEABLE:
        raise TracememError(f"--replace {spec!r}: {kind!r} cannot be replaced; choose one of "
                            f"{', '.join(REPLACEABLE)}")
    if isinstance(value, str):
        match = _SPEC.match(value.strip())
        if match is None:
            raise TracememError(f"--replace {spec!r} is invalid; give {kind}=pkg.module:Name "
                                f"or {kind}=path/to/file.py:Name")
        obj = _load(match["target"], spec)
        for part in match["name"].split("."):
            if not hasattr(obj, part):
                raise TracememError(f"--replace {spec!r}: {match['target']} has no "
                                    f"{match['name']!r}")
            obj = getattr(obj, part)
        value = obj
    if not callable(value):
        raise TracememError(f"--replace {spec!r}: {value!r} is not a class or factory "
                            f"(callable taking a modeling.common.custom.LayerContext)")
    return value


def resolve_replacements(replace: Mapping | Iterable[str] | None) -> Replacements:
    """``replace`` as ``{kind: factory}``: a mapping of kind ("attn", "mlp", "block") to a
    class / factory or a "pkg.module:Name" / "path/file.py:Name" string, or an iterable of
    "kind=spec" strings (the CLI's repeated ``--replace``). None: nothing replaced.

    Raises:
        TracememError: an unknown kind, a kind given twice, "block" with "attn" or "mlp", a
            malformed spec, a module that does not import, a missing name, not callable.
    """
    if replace is None:
        return {}
    items: list[tuple[str, object, str]] = []
    if isinstance(replace, Mapping):
        items = [(k, v, f"{k}={v if isinstance(v, str) else getattr(v, '__name__', v)}")
                 for k, v in replace.items()]
    elif isinstance(replace, str):
        raise TracememError(f"replace={replace!r} must be a list of kind=spec strings or a "
                            f"dict, not one string")
    else:
        for spec in replace:
            if not isinstance(spec, str) or "=" not in spec:
                raise TracememError(f"--replace {spec!r} is invalid; give KIND=pkg.module:Name "
                                    f"(KIND one of {', '.join(REPLACEABLE)})")
            kind, _, value = spec.partition("=")
            items.append((kind.strip(), value, spec))
    out: Replacements = {}
    for kind, value, spec in items:
        if kind in out:
            raise TracememError(f"--replace {spec!r}: {kind} is replaced twice; give it once")
        out[kind] = _resolve_one(kind, value, spec)
    if "block" in out and ({"attn", "mlp"} & set(out)):
        raise TracememError("--replace block= replaces the whole layer; drop --replace "
                            f"{' and '.join(sorted({'attn', 'mlp'} & set(out)))}=")
    return out


def build_replacement(factory: Callable, kind: str, ctx: LayerContext) -> nn.Module:
    """``factory(ctx)``, checked to be an ``nn.Module``.

    Raises:
        TracememError: it returned something else, or calling it raised (the exception's
            type and first line are kept).
    """
    try:
        module = factory(ctx)
    except TracememError:
        raise
    except TypeError as error:  # a factory that does not take the context
        raise TracememError(f"--replace {kind}={getattr(factory, '__name__', factory)}: "
                            f"calling it with a modeling.common.custom.LayerContext failed: "
                            f"{error}".splitlines()[0]) from error
    except Exception as error:  # the user's own __init__ failed: say so in one line
        raise TracememError(f"--replace {kind}={getattr(factory, '__name__', factory)}: "
                            f"building it raised {type(error).__name__}: "
                            f"{error}".splitlines()[0]) from error
    if not isinstance(module, nn.Module):
        raise TracememError(f"--replace {kind}={getattr(factory, '__name__', factory)} "
                            f"returned {type(module).__name__}, not an nn.Module")
    module.forward = _guarded(module.forward, f"--replace {kind}="
                              f"{getattr(factory, '__name__', factory)}")
    return module


def _guarded(forward: Callable, label: str) -> Callable:
    """``forward``, with any error but tracemem's own (a data-dependent op, a missing meta
    kernel: they already name the op and the fix) said in one line, and its result held to
    the calling convention: the input's shape ``(b, s_local, h)``.

    Raises:
        TracememError: the user's layer raised while the model ran, or returned another shape.
    """

    @functools.wraps(forward)
    def run(*args, **kwargs):
        try:
            out = forward(*args, **kwargs)
        except TracememError:
            raise
        except Exception as error:
            if type(error).__module__ == "torch.utils.checkpoint":  # its early-stop signal
                raise
            raise TracememError(f"{label}: its forward raised {type(error).__name__}: "
                                f"{error}".splitlines()[0]) from error
        x = args[0] if args else None
        if isinstance(x, Tensor) and (not isinstance(out, Tensor)
                                            or out.shape != x.shape):
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise TracememError(f"{label}: its forward returned {got} for an input of "
                                f"{tuple(x.shape)}; it must return the input's shape "
                                f"(b, s_local, h)")
        return out

    return run


class CustomBlock(nn.Module):
    """A user's decoder layer (``--replace block=...``) held as ``custom``, with the layer
    interface the model and ``tracemem`` use: ``forward(x, routing)`` and ``set_recompute``
    ("none" or "full": the whole layer under non-reentrant ``torch.utils.checkpoint``)."""

    def __init__(self, module: nn.Module, layer_id: int):
        super().__init__()
        self.custom = module
        self.layer_id = layer_id
        self.recompute = "none"

    def set_recompute(self, recompute: str, modules: frozenset[str] = frozenset()) -> None:
        """Raises TracememError: "selective" (it names parts of tracemem's own layer) or an
        unknown mode."""
        if recompute not in ("none", "full"):
            raise TracememError(f"--recompute {recompute} names parts of tracemem's decoder "
                                f"layer; a replaced block (--replace block=) takes --recompute "
                                f"none or full")
        self.recompute = recompute

    def forward(self, x: Tensor, routing) -> Tensor:
        if self.recompute == "full":
            return checkpoint(self.custom, x, routing, use_reentrant=False)
        return self.custom(x, routing)
