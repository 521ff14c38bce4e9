"""The cost table a command line plans with: --costs, a preset's analytic model, or a captured factory."""

from __future__ import annotations

import argparse

from fxkfac.cli_args import AUTO, CliError, device, kind, micro_batch_size
from fxkfac.cli_targets import factory, is_factory
from fxkfac.planner.problem import CostTable, PreconditionerKind, ProfileLayers, load_cost_table
from fxkfac.planner.problem.costs import WORDS
from fxkfac.planner.problem.profiles import is_profile


def stage_blocks(target: str, blocks: int, D: int, S: int) -> list[int]:
    """A profile's `blocks` Transformer blocks over S stages on D ranks: evenly, or where S is a multiple of D (v
    stages per rank) each rank's even share split over its v stages, its earlier chunks the larger (stage s is
    chunk s // D of its rank in interleaved, zb-1p and zb-v alike); CliError where neither cut is whole."""
    if blocks % S == 0:
        return [blocks // S] * S
    per_rank, v = blocks // D, S // D
    if blocks % D or S % D or per_rank < v:
        raise CliError(f"{target} has {blocks} blocks, not divisible into {S} stages; pick another -D")
    return [per_rank // v + (s // D < per_rank % v) for s in range(S)]


def cost_table(args: argparse.Namespace, S: int, max_dim: int | None = None) -> CostTable:
    """The cost table the plan uses: --costs file, a preset's analytic model (Shampoo/SOAP: with blocks of side
    `max_dim`, None for none, when --max-preconditioner-dim is auto), or a captured factory (K-FAC)."""
    family = kind(args)
    if family is not PreconditionerKind.KFAC:
        _check_gradient_family(args, family)
    if family in (PreconditionerKind.KFAC, PreconditionerKind.MUON) and args.max_preconditioner_dim != AUTO:
        raise CliError(
            f"--max-preconditioner-dim sets Shampoo's and SOAP's blocks; {WORDS[family].name} has none (pass "
            "--preconditioner shampoo or soap, or drop it)"
        )
    if args.profile_layers is not ProfileLayers.BLOCK and (args.costs is None or not is_profile(args.costs)):
        raise CliError(
            "--profile-layers splits the blocks of a PipeFisher profile; pass one as --costs (e.g. "
            "paper:bert-base/p100) or drop it"
        )
    if args.costs is not None:
        if is_profile(args.costs):
            table = load_cost_table(
                args.costs,
                blocks_per_stage=stage_blocks(args.target, _blocks(args.target), args.stages, S),
                micro_batch_size=micro_batch_size(args),
                layers=args.profile_layers,
            )
        else:
            table = load_cost_table(args.costs)
        if table.family is not family:
            raise CliError(
                f"{args.costs} is a cost table of {WORDS[table.family].name}, not of "
                f"{WORDS[family].name}; pass --preconditioner {table.family.value}"
            )
    elif is_factory(args.target):
        table = factory(args, S).costs
    else:
        from fxkfac.planner.problem.analytic import analytic_cost_table

        side = max_dim if args.max_preconditioner_dim == AUTO else args.max_preconditioner_dim
        table = analytic_cost_table(
            args.target, S, micro_batch_size(args), args.seq_len, device(args), kind=family, max_dim=side
        )
    if len(table.stages) != S:
        raise CliError(f"the cost table has {len(table.stages)} stages but the schedule needs {S}")
    return table


def _blocks(target: str) -> int:
    from fxkfac.planner.problem.analytic import preset

    return len(preset(target).blocks)


def _check_gradient_family(args: argparse.Namespace, family: PreconditionerKind) -> None:
    """What Shampoo/SOAP plan: a preset's analytic costs, or a .json cost table of their parameters (whose
    blocks it fixes); a K-FAC profile or a factory target (costed as K-FAC layers) is refused."""
    name = WORDS[family].name
    if is_factory(args.target) and args.costs is None:
        raise CliError(
            f"--preconditioner {family.value}: a factory target is costed as K-FAC layers only; plan "
            f"{name} on a preset (analytic costs of every parameter) or pass --costs TABLE.json "
            f"(a {name} cost table, e.g. profiled by plan='auto')"
        )
    if args.costs is not None and is_profile(args.costs):
        raise CliError(
            f"--costs {args.costs} is a K-FAC per-block profile; {name} plans with a preset's analytic "
            f"costs or a {name} cost table (.json)"
        )
    if args.costs is not None and args.max_preconditioner_dim != AUTO:
        raise CliError(f"--costs {args.costs} fixes the blocks of every parameter; drop --max-preconditioner-dim")
