"""The parallel machinery of the decoder-only language models (GPT, Llama, MoE), written once.

The families are ``embed -> blocks[0..n) -> norm -> head``, each a child module that takes and
returns one tensor, and declare their module names as a :class:`DecoderLayout`
(``models/parallel_spec.py``). :class:`Decoder` turns that declaration into what the layouts ask
of a model: the blocks FSDP, activation checkpointing and compile wrap one at a time, the
pipeline units, and the Megatron-style tensor-parallel plan. The checks every family's sizes
face before launch (the data's vocabulary and context, whole heads per rank, even sequence
shards) are here too, each message written once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from sdnet_trainer.config.schema import Config
from sdnet_trainer.data import is_language_model_data
from sdnet_trainer.errors import ConfigError
from sdnet_trainer.lazy import loaded_types
from sdnet_trainer.models.init import (
    Draw,
    InitStep,
    SeedDraw,
    construction_resets,
    draw_seed,
    materialize,
    without_parameters,
)
from sdnet_trainer.models.init_values import Constant, Distribution, Normal
from sdnet_trainer.models.parallel_spec import DecoderLayout


def check_sequence(length: int, *, seq_len: int, sequence_shards: int, context_key: str) -> None:
    """A batch's sequence length against the model's context (``context_key``, e.g.
    ``model.gpt.seq_len``) and, under sequence parallel, the even split over the shards."""
    if length > seq_len:
        raise ConfigError(
            f"a batch of {length} tokens per sequence is longer than the model's "
            f"context {context_key}={seq_len}; set data.seq_len <= {seq_len}"
        )
    if length % sequence_shards:
        raise ConfigError(
            f"sequence parallel splits each sequence over parallel.tp={sequence_shards} "
            f"ranks; {length} tokens per sequence do not divide evenly (data.seq_len must be "
            f"a multiple of parallel.tp)"
        )


# How a size check names a size in its message: ``model.llama.dim=64``, or a Hugging Face
# config.json's field.
Named = Callable[[str, Any], str]


def check_data_and_stages(cfg: Config, sizes: Mapping[str, Any], *, pp: int, named: Named) -> None:
    """A decoder's vocabulary and context (``sizes``) against the language-model data, and a
    tied embedding against a pipeline split, before launch."""
    data = cfg.data
    if is_language_model_data(data):
        if data.vocab_size != sizes["vocab_size"]:
            raise ConfigError(
                f"data.vocab_size={data.vocab_size} differs from the model's "
                f"{named('vocab_size', sizes['vocab_size'])}"
            )
        if data.seq_len > sizes["seq_len"]:
            raise ConfigError(
                f"data.seq_len={data.seq_len} is longer than the model's context "
                f"{named('seq_len', sizes['seq_len'])}"
            )
    if pp > 1 and sizes.get("tie_embeddings"):
        raise ConfigError(
            f"{named('tie_embeddings', 'true')} with parallel.pp={pp}: the token embedding and the "
            f"output layer share one weight and cannot live on different pipeline stages"
        )


def check_head_shards(heads: Mapping[str, int], *, tp: int, named: Named) -> None:
    """Tensor parallelism gives each rank whole attention heads: each head count (by its key)
    divides by ``tp``."""
    for key, value in heads.items():
        if value % tp:
            raise ConfigError(
                f"{named(key, value)} must be divisible by parallel.tp={tp}: tensor parallelism "
                f"gives each rank whole attention heads"
            )


def check_sequence_shards(seq_len: int, *, tp: int, sequence_parallel: bool, named: Named) -> None:
    """Sequence parallel splits the context evenly over the ``tp`` ranks."""
    if sequence_parallel and seq_len % tp:
        raise ConfigError(
            f"{named('seq_len', seq_len)} must be divisible by parallel.tp={tp} with "
            f"parallel.tensor_parallel.sequence_parallel=true"
        )


# GPT-2's initialisation: small enough that a deep stack starts near the identity function.
INIT_STD = 0.02


class Decoder(nn.Module):
    """Base of the decoder families: subclasses build ``embed``, ``blocks``, ``norm`` and
    ``head``, set ``layout``, and check their sizes against a tensor-parallel degree in
    :meth:`check_tensor_parallel`.

    A pipeline split sets the units other stages hold to None; every method here skips them."""

    layout: ClassVar[DecoderLayout]
    n_layers: int
    # The model.* section a family's sizes come from, for messages (model.llama, model.moe).
    config_key: ClassVar[str] = "model"
    embed: nn.Module
    blocks: nn.ModuleList
    norm: nn.Module
    head: nn.Linear
    # The output layer shares the token embedding's weights (Llama 3.2 1B and 3B): one parameter
    # under two names, which pipeline parallelism cannot split over stages.
    tie_embeddings: bool = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def __init__(self) -> None:
        super().__init__()
        # The seed of every parameter's Draw (models/init.py): the one number construction draws
        # from the CPU generator, so a build after torch.manual_seed(s) has the same weights on
        # the CPU and on the meta device, materialised later on any layout.
        self.init_seed = draw_seed()
        # The layers a CPU build constructs draw their defaults (nn.Linear's), which the Draws
        # replace; apply_own_init puts the generator back here, where a meta build leaves it.
        self._generator_after_seed = torch.get_rng_state()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every parameter as construction sets it (:meth:`init_steps`); works on a model
        materialised from the meta device and on sharded (DTensor) parameters alike."""
        materialize(self.init_steps())

    def init_steps(self) -> list[InitStep]:
        """The seed's draw again (:class:`SeedDraw`: the generator then ends where a CPU build
        leaves it), construction's resets of the modules that own no parameters (computed
        buffers: rotary frequencies, routing statistics), then every parameter's :class:`Draw`
        (:meth:`own_init_steps`)."""
        buffers = without_parameters(construction_resets(self.modules()))
        return [InitStep(self, SeedDraw()), *buffers, *self.own_init_steps()]

    def own_init_steps(self) -> list[InitStep]:
        """Every parameter's Draw from its distribution (:meth:`distribution`), under its name in
        the model as built (a tied weight once, as the embedding)."""
        residual_std = INIT_STD / math.sqrt(2 * self.n_layers)
        steps = []
        for key, _ in self.named_parameters():
            owner, _, name = key.rpartition(".")
            module = self.get_submodule(owner)
            dist = self.distribution(key, module, name, residual_std=residual_std)
            steps.append(InitStep(module, Draw(name, key, dist, self.init_seed)))
        return steps

    def distribution(
        self, key: str, module: nn.Module, name: str, *, residual_std: float
    ) -> Distribution:
        """GPT-2's init, which every family here follows: normal(0, 0.02) weights of the linear
        layers and embeddings, the projections that write into the residual stream (``wo``,
        ``w2``) at 0.02/sqrt(2 n_layers) so the stream's variance does not grow with depth, zero
        biases, LayerNorms at identity; any other parameter as the family's
        :meth:`module_distribution` says."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            if name == "bias":
                return Constant(0.0)
            return Normal(residual_std if key.endswith((".wo.weight", ".w2.weight")) else INIT_STD)
        if isinstance(module, nn.LayerNorm):
            return Constant(1.0 if name == "weight" else 0.0)
        dist = self.module_distribution(module, name, residual_std=residual_std)
        if dist is None:
            raise TypeError(f"{type(self).__name__} declares no initial distribution for {key}")
        return dist

    def module_distribution(
        self, module: nn.Module, name: str, *, residual_std: float
    ) -> Distribution | None:
        """A family's distribution for parameter ``name`` of ``module``, a module other than the
        linear layers, embeddings and LayerNorms (an RMSNorm, a mixture of experts' stacked
        experts); None: none declared (an error)."""
        return None

    @torch.no_grad()
    def apply_own_init(self) -> None:
        """At the end of construction: every parameter's Draw (nothing on the meta device), and
        the generator put back to where the seed's draw left it."""
        for step in self.own_init_steps():
            step.fn(step.module)
        torch.set_rng_state(self.__dict__.pop("_generator_after_seed"))

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # Module._apply (to(), to_empty(): the allocation after a meta build) makes a new
        # parameter per module, which would untie the output layer from the embedding.
        result = super()._apply(fn, recurse)
        self._tie()
        return result

    def _tie(self) -> None:
        embed, head = getattr(self, "embed", None), getattr(self, "head", None)
        if self.tie_embeddings and embed is not None and head is not None:
            head.weight = embed.tok.weight

    def pipeline_units(self) -> list[str]:
        """Child module names whose sequential application (``x = unit(x)``) equals ``forward``."""
        if self.tie_embeddings:
            raise ConfigError(
                f"{self.config_key}.tie_embeddings=true shares one weight between the token "
                f"embedding (first pipeline stage) and the output layer (last): use "
                f"parallel.pp=1 or an untied model"
            )
        blocks: Any = self.get_submodule("blocks")  # the split asks before pruning
        return ["embed", *(f"blocks.{i}" for i in range(len(blocks))), "norm", "head"]

    def parallel_blocks(self) -> list[nn.Module]:
        """The repeated units to wrap one by one (FSDP, activation checkpointing, compile)."""
        blocks = getattr(self, "blocks", None)
        return list(blocks) if blocks is not None else []

    def check_tensor_parallel(self, tp: int, *, sequence_parallel: bool) -> None:
        raise NotImplementedError

    def apply_tensor_parallel(
        self, tp_mesh: DeviceMesh, *, loss_parallel: bool, sequence_parallel: bool
    ) -> None:
        """Shard the model over ``tp_mesh`` (a 1-D DeviceMesh) in place, Megatron-style.

        Every rank gets the full (B, T) token tensor. Per block, each region's ``colwise``
        projections (q/k/v, the MLP's input projections) are split by output columns and its
        ``rowwise`` ones (``wo``, ``w2``) by input rows, so each block needs one all-reduce in
        forward for attention and one for the MLP (a reduce-scatter plus an all-gather with
        ``sequence_parallel``, which also splits norms, dropout and the residual stream along the
        sequence). The output is the full logits tensor on every rank, or with ``loss_parallel``
        a DTensor sharded over the vocabulary (``Shard(-1)``), for a cross-entropy computed under
        ``torch.distributed.tensor.parallel.loss_parallel()``. Every parameter becomes a DTensor
        on ``tp_mesh``, so optimizers and gradient clipping see one kind of tensor.

        Attention derives its head counts from the *local* projection widths, so the same forward
        runs whether a rank holds all heads or only its share. Units a pipeline split has pruned
        (set to None) are skipped, so a pipeline stage can be sharded after the split.
        """
        tp = tp_mesh.size()
        # The same rules the family's validator applies before launch; model.kwargs can override
        # those sizes, and a model can be built without the config.
        self.check_tensor_parallel(tp, sequence_parallel=sequence_parallel)
        apply_decoder_tp(
            self,
            self.layout,
            tp_mesh,
            loss_parallel=loss_parallel,
            sequence_parallel=sequence_parallel,
        )
        embed = getattr(self, "embed", None)
        if sequence_parallel and embed is not None:
            embed.sequence_shards = tp
        # A tied pair is split by vocabulary rows (Shard(0)); the plan gave each its own DTensor
        # parameter, which are made one again.
        self._tie()


class Replicated(ParallelStyle):
    """Parameters replicated as DTensors; plain tensor inputs are taken as replicated.

    torch's TP styles have none for "the same on every rank": without it the norms (without
    sequence parallel) and the position embedding would keep plain-tensor parameters beside
    DTensor ones, which foreach optimizers and gradient clipping refuse to mix.
    """

    def __init__(self, *, use_local_output: bool = True) -> None:
        super().__init__()
        self.use_local_output = use_local_output

    @staticmethod
    def _prepare_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(t, mesh, (Replicate(),), run_check=False)
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
            else t
            for t in inputs
        )

    @staticmethod
    def _prepare_output(
        use_local_output: bool, module: nn.Module, output: Any, mesh: DeviceMesh
    ) -> Any:
        return output.to_local() if use_local_output and isinstance(output, DTensor) else output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # No partition function: distribute_module replicates every parameter, broadcasting from
        # rank 0 so the copies agree even where the ranks initialised differently.
        return distribute_module(
            module,
            device_mesh,
            None,
            # torch annotates input_fn as returning None, but the forward pre-hook it installs
            # passes on the inputs it returns (as its docstring says).
            self._prepare_input,  # type: ignore[arg-type]
            partial(self._prepare_output, self.use_local_output),
        )


def apply_decoder_tp(
    model: nn.Module,
    layout: DecoderLayout,
    mesh: DeviceMesh,
    *,
    loss_parallel: bool,
    sequence_parallel: bool,
) -> None:
    """The plan of :meth:`Decoder.apply_tensor_parallel` for ``layout``'s module names."""
    # The layout of the residual stream between TP regions: the whole sequence on every rank, or
    # each rank's slice of it. It is passed around as plain local tensors, as torchtitan does.
    stream = Shard(1) if sequence_parallel else Replicate()

    def norm_style() -> ParallelStyle:
        return SequenceParallel() if sequence_parallel else Replicated()

    top_plan: dict[str, ParallelStyle] = {
        # Vocabulary rows split over ranks; the partial sums are reduced straight into `stream`
        # (an all-reduce, or a reduce-scatter under sequence parallel).
        "embed.tok": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=stream, use_local_output=False
        ),
        # Small tables (a position embedding): replicated, added to the tokens as DTensors.
        **{name: Replicated(use_local_output=False) for name in layout.replicated},
        "embed": PrepareModuleOutput(
            output_layouts=stream, desired_output_layouts=stream, use_local_output=True
        ),
        "norm": norm_style(),
        "head": ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    present = {name for name, child in model.named_children() if child is not None}
    plan = {key: style for key, style in top_plan.items() if key.split(".")[0] in present}
    if plan:
        parallelize_module(model, mesh, plan)
    blocks = getattr(model, "blocks", None)
    for block in blocks if blocks is not None else ():
        if block is None:
            continue
        block_plan: dict[str, ParallelStyle] = {norm: norm_style() for norm in layout.norms}
        for region in layout.regions:
            # One gather of the region's input for all its column-split projections together (and
            # in backward one reduction of their input gradients) instead of one per projection.
            block_plan[region.name] = PrepareModuleInput(
                input_layouts=(stream,), desired_input_layouts=(Replicate(),)
            )
            # A tensorwise float8 projection takes torchao's variants of these styles, which cast
            # to float8 on the DTensors, before any layout change (torchtitan's float8 TP plan).
            for name in region.colwise:
                colwise, _ = tensor_parallel_styles(block.get_submodule(f"{region.name}.{name}"))
                block_plan[f"{region.name}.{name}"] = colwise()
            for name in region.rowwise:
                _, rowwise = tensor_parallel_styles(block.get_submodule(f"{region.name}.{name}"))
                block_plan[f"{region.name}.{name}"] = rowwise(output_layouts=stream)
        parallelize_module(block, mesh, block_plan)


def tensor_parallel_styles(
    linear: nn.Module,
) -> tuple[type[ColwiseParallel], type[RowwiseParallel]]:
    """The column- and row-wise TP styles for ``linear``: torchao's float8 ones for a tensorwise
    Float8Linear (they cast its input to float8 as a DTensor before the layout changes, and its
    output gradient in backward), torch's for anything else. torchao's float8 styles implement
    tensorwise scaling only; a rowwise Float8Linear casts inside its own matmul, under torch's
    styles, as torchtitan runs it."""
    float8_linear = loaded_types("torchao.float8.float8_linear", "Float8Linear")
    if not isinstance(linear, float8_linear):
        return ColwiseParallel, RowwiseParallel
    from torchao.float8.config import ScalingGranularity

    config: Any = linear.config
    if config.cast_config_input.scaling_granularity is not ScalingGranularity.TENSORWISE:
        return ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    return Float8ColwiseParallel, Float8RowwiseParallel


__all__ = [
    "INIT_STD",
    "Decoder",
    "Replicated",
    "apply_decoder_tp",
    "tensor_parallel_styles",
]
