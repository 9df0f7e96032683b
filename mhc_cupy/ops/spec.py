"""One spec per kernel entry point (an op's forward or backward): its arrays and parameters.

Each family module declares ``KERNELS`` beside its planners; :data:`mhc_cupy.ops.SPECS`
collects them by name.  The JAX kernel specs, the torch fake functions, the warm-up list
of specialisations (``mhc_cupy._kernels``) and the benchmark's inputs and byte model are
derived from this table.

Shape codes: ``...`` the token dims (any number, in front), then one letter per dim
(``"...nC"`` = [..., n, C]: n streams, C hidden size), or comma-separated dims where a dim
may be a product (``"nC,K"`` = [n*C, K]).  ``K`` = n*n + 2n (the columns of phi, OPS.md
section 8); a dim may also be a number (``"3"``) or ``"K+1"``.

Kinds: "activation" (bfloat16 / float16 / float32, the dtype of x), "coefficient" (float32,
per token), "parameter" (float32, without token dims), "fp8" (float8 e4m3fn; an output only).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Arg:
    """One array: ``name`` (the planner's key), ``shape`` code, ``kind``; ``optional``: may be None."""

    name: str
    shape: str
    kind: str
    optional: bool = False

    @property
    def per_token(self) -> bool:
        return self.shape.startswith("...")

    @property
    def dims(self) -> tuple:
        body = self.shape.removeprefix("...")
        if "," in body:
            return tuple(body.split(","))
        return tuple(body) if body.isalpha() else (body,)

    @property
    def rank(self) -> int:
        """Number of trailing (non-token) dims."""
        return len(self.dims)


def dim_size(dim: str, sizes: dict):
    """Size of one dim code: a number, ``a+b``, or a product of letters (``"nC"`` = n*C)."""
    if dim.isdigit():
        return int(dim)
    if "+" in dim:
        return sum(dim_size(d, sizes) for d in dim.split("+"))
    size = 1
    for letter in dim:
        size = size * sizes[letter]
    return size


def shape_of(arg: Arg, lead: tuple, sizes: dict) -> tuple:
    """The shape of ``arg`` for token dims ``lead`` and letter sizes ``sizes`` (``n``, ``C``, ``K``)."""
    return (tuple(lead) if arg.per_token else ()) + tuple(dim_size(d, sizes) for d in arg.dims)


@dataclass(frozen=True)
class Kernel:
    """One entry point: ``planner(infos, **params)`` with ``infos`` keyed by ``grads + inputs``.

    ``inputs``: the op's arrays; ``grads``: the incoming gradients (a backward), in front.
    ``outputs``: new arrays, or one of ``inputs`` for the gradient of that input (same shape
    and kind; absent when that optional input is None).  ``params``: the planner's keyword
    parameters and their defaults.  ``shared``: the input that may be shared by all tokens (``h`` [n] of
    aggregate / distribute, RMSNorm's ``weight``); ``shared_mode``: "expand" (a per-token form
    exists) or "sequential".
    """

    name: str
    planner: object
    inputs: tuple
    outputs: tuple
    grads: tuple = ()
    params: dict = field(default_factory=dict)
    shared: str | None = None
    shared_mode: str = "expand"

    @property
    def args(self) -> tuple:
        return self.grads + self.inputs

    @property
    def names(self) -> tuple:
        return tuple(a.name for a in self.args)

    @property
    def ref(self) -> Arg:
        """The input whose leading dims are the token dims: x ([..., n, C]) if given, else the first."""
        return next((a for a in self.inputs if a.shape == "...nC"), self.inputs[0])

    def is_grad(self, out: Arg) -> bool:
        return out in self.inputs

    def sizes(self, shapes: dict) -> dict:
        """Letter sizes (n, C, K) read off the given input shapes (None: absent)."""
        sizes = {}
        for a in self.args:
            shape = shapes.get(a.name)
            if shape is not None:
                for d, s in zip(a.dims, tuple(shape)[len(shape) - a.rank:]):
                    if len(d) == 1 and d.isalpha():
                        sizes.setdefault(d, s)
        return sizes


# Arrays that several families share (OPS.md sections 3-9).
X = Arg("x", "...nC", "activation")
LAYER_IN = Arg("layer_in", "...C", "activation")
LAYER_OUT = Arg("layer_out", "...C", "activation")
H_PRE_RAW = Arg("h_pre_raw", "...n", "coefficient")
H_POST_RAW = Arg("h_post_raw", "...n", "coefficient")
H_RES_RAW = Arg("h_res_raw", "...nn", "coefficient")
H_PRE = Arg("H_pre", "...n", "coefficient")
H_POST = Arg("H_post", "...n", "coefficient")
H_RES = Arg("H_res", "...nn", "coefficient")
PHI, ALPHA, BIAS = Arg("phi", "nC,K", "parameter"), Arg("alpha", "3", "parameter"), Arg("bias", "K", "parameter")
#: The incoming gradient of an [..., n, C] output (activation dtype or float32).
GRAD_X = Arg("grad", "...nC", "activation")
#: The convention of the maths (OPS.md "DeepSeek-V4 convention"): "paper" or "deepseek".
CONVENTION = {"convention": "paper"}
#: Sinkhorn's parameters and their defaults (OPS.md section 1); a backward adds ``grad_mode``.
#: The values are the paper convention's (also the defaults of the registered torch custom-op
#: schemas: a direct ``torch.ops.mhc_cupy.*`` call under "deepseek" passes its settings); the
#: public functions default to ``mhc_cupy._convention.DEFAULT``, the convention's value.
SINKHORN_PARAMS = {"num_iters": 20, "eps": 1e-8, **CONVENTION}
#: The pre op's activation settings: H_pre = sigmoid + hc_eps, H_post = post_mult sigmoid.
ACTIVATION_PARAMS = {"hc_eps": 0.0, "post_mult": 2.0}
GRAD_MODE = {"grad_mode": "unrolled"}


def optional_grads(*outputs) -> tuple:
    """``grad_<name>`` for each output, each optional (None counts as zero, OPS.md section 7)."""
    return tuple(Arg("grad_" + a.name, a.shape, a.kind, optional=True) for a in outputs)
