"""Which runs a checkpoint loads into, and one rank's state under a new layout from every saved rank's skeleton.

Pure functions on the header's run descriptions and on the JSON skeletons of `fxkfac.checkpoint_files.split_tensors`
(tensor placeholders keep the checkpoint's DCP keys, so the tensors are read afterwards by key); no tensors,
no I/O. The rules are [Note: resharding] in fxkfac/checkpoint.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

from fxkfac.errors import CheckpointError

__all__ = [
    "LoadKind",
    "LAYOUT_FIELDS",
    "KEYED_SECTIONS",
    "LOCAL_SECTIONS",
    "check_run",
    "layout_changes",
    "replanned",
    "in_flight_refusal",
    "resharded_state",
    "work_in_flight",
    "quiet",
    "next_quiet_step",
]

KEYED_SECTIONS = ("model", "kfac")
"""Sections keyed by a global name (parameter FQN, unit name) whose entries follow their holder."""
LOCAL_SECTIONS = frozenset({"inflight", "rng"})
"""Top-level state sections that differ between ranks holding the same stage (keyed per rank)."""
_IN_FLIGHT_WORDS = {
    "refreshes": "open refreshes",
    "outbox": "decompositions waiting for their BCAST",
    "captures": "captures waiting for STATS",
}


# --- which runs a checkpoint loads into ---------------------------------------------------------------


class LoadKind(Enum):
    """How a checkpoint loads into a run (see [Note: resharding])."""

    SAME_LAYOUT = "same layout"
    """Every rank reads what its own rank wrote, work in flight included: resume is exact."""
    RESHARD = "reshard"
    """Every rank reads the entries of the parameters and units it holds now; nothing may be in flight."""


LAYOUT_FIELDS = (
    "mesh",
    "schedule",
    "microbatches",
    "virtual_stages",
    "global_batch",
    "stages",
    "graph",
    "plan",
    "timings",
    "programs",
)
"""The fields of `describe_run` that a checkpoint follows the state across."""


def _layout_words(run: Mapping[str, Any]) -> str:
    """A run's layout as the user wrote it."""
    D, W = run.get("mesh") or (None, None)
    return (
        f"{run['trainer']} {run['schedule']} D={D} W={W} N={run['microbatches']} v={run['virtual_stages']} "
        f"global batch {run['global_batch']}"
    )


def _names_words(saved: Mapping[str, Any], mine: Mapping[str, Any], what: str) -> str:
    only_saved, only_mine = sorted(set(saved) - set(mine)), sorted(set(mine) - set(saved))
    reshaped = sorted(n for n in set(saved) & set(mine) if saved[n] != mine[n])
    parts = [
        f"{what} only in the checkpoint {only_saved[:3]}" if only_saved else "",
        f"{what} only in this run {only_mine[:3]}" if only_mine else "",
        f"shapes differ for {[(n, saved[n], mine[n]) for n in reshaped[:3]]}" if reshaped else "",
    ]
    return "; ".join(p for p in parts if p)


def _family_words(trainer: Any) -> str:
    return "no preconditioner (preconditioner=None)" if trainer == "plain" else f"the {trainer} preconditioner"


def check_run(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> LoadKind:
    """How the checkpoint of run `saved` loads into run `mine`; CheckpointError when it holds another family's,
    model's or set of units' state (checked in that order)."""
    if saved.get("trainer") != mine.get("trainer"):
        raise CheckpointError(
            f"checkpoint made for {_family_words(saved.get('trainer'))}, this run trains with "
            f"{_family_words(mine.get('trainer'))}; its state belongs to another family: compile "
            "with the preconditioner it was written with"
        )
    if saved.get("params") != mine.get("params"):
        raise CheckpointError(
            f"checkpoint made for another model, this run is {len(mine['params'])} parameters "
            f"({_names_words(saved.get('params') or {}, mine['params'], 'parameters')}); "
            "load it into the model it was written for"
        )
    if saved.get("units") != mine.get("units"):
        raise CheckpointError(
            f"checkpoint made for other {mine['trainer']} units than this run's "
            f"({_names_words(saved.get('units') or {}, mine['units'], 'units')}): the stage "
            "split or the model changed which layers are preconditioned; resume with the "
            "split_points and model it was written with"
        )
    same = all(saved.get(k) == mine.get(k) for k in LAYOUT_FIELDS)
    return LoadKind.SAME_LAYOUT if same else LoadKind.RESHARD


PLAN_FIELDS = frozenset({"plan", "timings", "programs"})
"""The fields of `describe_run` a plan sets: what differs when plan="auto" planned again on the same layout."""


def replanned(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> bool:
    """True when two runs differ in their plan alone (the same mesh, schedule, micro-batches, split and graph)."""
    differ = {k for k in LAYOUT_FIELDS if saved.get(k) != mine.get(k)}
    return bool(differ) and differ <= PLAN_FIELDS


def layout_changes(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> str:
    """What differs between two runs' layouts, in words (``"mesh [1, 2] -> [1, 4]; plan changed"``)."""

    def change(key: str) -> str:
        before, after = json.dumps(saved.get(key)), json.dumps(mine.get(key))
        return f"{key} {before} -> {after}" if len(before) + len(after) <= 48 else f"{key} changed"

    return "; ".join(change(k) for k in LAYOUT_FIELDS if saved.get(k) != mine.get(k)) or "world size changed"


# --- work in flight ------------------------------------------------------------------------------------


def holds_nothing(value: Any) -> bool:
    """True for empty containers (and None), however deeply nested: what a rank with no work in flight saves."""
    if isinstance(value, dict):
        return all(holds_nothing(v) for v in value.values())
    if isinstance(value, list):
        return not value
    return value is None


def work_in_flight(saved: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """What each saved rank had in flight, in words (``"rank 1: open refreshes of ['0', '2']"``); [] when nothing."""
    found = []
    for rank, skeleton in sorted(saved.items()):
        inflight = skeleton.get("inflight") or {}
        busy = [_busy_words(key, value) for key, value in inflight.items() if not holds_nothing(value)]
        if busy:
            found.append(f"rank {rank}: {', '.join(busy)}")
    return found


def _busy_words(key: str, value: Any) -> str:
    words = _IN_FLIGHT_WORDS.get(key, key)
    if isinstance(value, dict):
        return f"{words} of {sorted(k for k, v in value.items() if not holds_nothing(v))[:4]}"
    return f"{words} ({len(value)})" if isinstance(value, list) else words


def _emptied(skeleton: Any) -> Any:
    """The same containers holding nothing: dicts keep their keys, lists are emptied (a rank's idle in-flight state)."""
    if isinstance(skeleton, dict):
        return {k: _emptied(v) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return []
    return None


def quiet(step: int, timings: Mapping[str, Sequence[Any]]) -> bool:
    """True when a run with these layer timings (``[period, curv_step, use_offset, capture]``) has finished every
    refresh begun before `step` by the time `step` begins: a refresh at t runs its ops in steps t .. t + use_offset,
    so none is open iff the last refresh before `step` is older than use_offset steps (or there is none)."""
    for period, curv_step, use_offset, *_ in timings.values():
        last = step - 1 - (step - 1 - curv_step) % period
        if last >= 0 and last + use_offset >= step:
            return False
    return True


def next_quiet_step(after: int, runs: Iterable[Mapping[str, Sequence[Any]]]) -> int | None:
    """The first step after `after` that is `quiet` under every one of the runs' timings; None when there is none
    (some use_offset >= period: a refresh is always open)."""
    runs = list(runs)
    period = math.lcm(*(int(t[0]) for timings in runs for t in timings.values())) if any(runs) else 1
    return next((s for s in range(after + 1, after + 1 + period) if all(quiet(s, t) for t in runs)), None)


def _quiet_words(step: int, runs: list[Mapping[str, Any]]) -> str:
    """Where to save instead of `step` so that a checkpoint reshards: the next step quiet under the runs' timings."""
    then = next_quiet_step(step, runs)
    if then is None:
        return (
            "its layer timings never have one (use_offset >= period for some layer): save with timings whose "
            "use_offset is below their period"
        )
    return (
        f"for these layer timings step {then} (any step s with (s - 1 - curv_step) % period >= use_offset for "
        "every layer, counting steps done)"
    )


def in_flight_refusal(
    path: Path, header: Mapping[str, Any], mine: Mapping[str, Any], saved: Mapping[int, Mapping[str, Any]]
) -> str | None:
    """Why a resharded load cannot place the checkpoint's work in flight, or this run's plan would expect work
    from before the resumed step; None when it can resume."""
    step, run = int(header["step"]), header["run"]
    busy = work_in_flight(saved)
    if busy:
        return (
            f"checkpoint {path} was saved at step {step} with work in flight ({'; '.join(busy[:3])}), which "
            f"belongs to the ranks and plan that made it and cannot follow the state onto this layout "
            f"({layout_changes(run, mine)}); save where no refresh is in flight, "
            f"{_quiet_words(step, [run['timings']])}, or train with plan=None (its refreshes finish within "
            f"their step), or resume with the layout it was written with ({_layout_words(run)})"
        )
    if mine.get("plan") is not None and not quiet(step, mine["timings"]):
        late = sorted(n for n, t in mine["timings"].items() if not quiet(step, {n: t}))
        return (
            f"this run's plan finishes at step {step} refreshes begun before it (layers {late[:4]}), which "
            f"the run of checkpoint {path} finished or never began; resume from a checkpoint saved at a step "
            f"quiet under both runs' timings, {_quiet_words(step, [run['timings'], mine['timings']])}, or "
            "compile this run with plan=None"
        )
    return None


# --- merging the saved ranks ------------------------------------------------------------------------------


def _entries(value: Any) -> set[str]:
    return set(value) if isinstance(value, dict) else set()


def _fullest(section: str, name: str, copies: list[tuple[int, Any]]) -> Any:
    """The copy of one entry with the most entries, of which every other copy's entries must be a subset."""
    rank, best = max(copies, key=lambda c: len(_entries(c[1])))  # ties: the lowest rank (copies are in rank order)
    for other, value in copies:
        extra = sorted(_entries(value) - _entries(best))
        if extra:
            raise CheckpointError(
                f"checkpoint {section} state of {name!r} differs between rank {rank} and rank "
                f"{other} (only rank {other} wrote {extra[:4]}), and neither holds all of the "
                "other's entries, so it cannot follow the state onto another layout; resume with "
                "the layout it was written with"
            )
    return best


def fullest_copies(section: str, by_rank: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """Per name, the fullest copy any rank wrote of `section`'s entry for that name (see `_fullest`)."""
    copies: dict[str, list[tuple[int, Any]]] = {}
    for rank, entries in sorted(by_rank.items()):
        for name, value in entries.items():
            copies.setdefault(name, []).append((rank, value))
    return {name: _fullest(section, name, found) for name, found in copies.items()}


def _pick(section: str, merged: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]:
    """This rank's entries of a keyed section; CheckpointError when the checkpoint has none for a name."""
    names = list(names)
    missing = [n for n in names if n not in merged]
    if missing:
        raise CheckpointError(
            f"checkpoint has no {section} state of {missing[:4]}, which this rank holds; it is "
            "incomplete or was written for another model"
        )
    return {n: merged[n] for n in names}


def _settings(saved: Mapping[int, Mapping[str, Any]]) -> dict[str, set[str]]:
    """Parameter FQN -> the settings (everything but ``params``, as canonical JSON) of the groups holding it."""
    out: dict[str, set[str]] = {}
    for skeleton in saved.values():
        for group in skeleton["param_groups"]:
            text = json.dumps({k: v for k, v in group.items() if k != "params"}, sort_keys=True)
            for fqn in group["params"]:
                out.setdefault(fqn, set()).add(text)
    return out


def _resharded_optimizer(saved: Mapping[int, Mapping[str, Any]], mine: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's optimizer skeleton: each parameter's state from the checkpoint, and each of its groups with the
    settings the checkpoint's groups had for those parameters (learning rate schedules included)."""
    settings = _settings(saved)
    groups = []
    for group in mine["param_groups"]:
        missing = [fqn for fqn in group["params"] if fqn not in settings]
        found = {text for fqn in group["params"] for text in settings.get(fqn, ())}
        if missing or len(found) > 1:
            raise CheckpointError(
                f"checkpoint optimizer groups give the parameters {group['params'][:4]} of one "
                f"group here {f'no settings ({missing[:4]})' if missing else 'different settings'}"
                "; resume with the optimizer groups it was written with"
            )
        groups.append({**json.loads(found.pop()), "params": list(group["params"])} if found else dict(group))
    state = fullest_copies("optimizer", {r: s["state"] for r, s in saved.items()})
    names = [fqn for g in mine["param_groups"] for fqn in g["params"]]
    return {"state": {fqn: state[fqn] for fqn in names if fqn in state}, "param_groups": groups}


def _agreed(section: str, saved: Mapping[int, Mapping[str, Any]]) -> Any:
    """A section every rank wrote alike (the step counters)."""
    values = {json.dumps(s.get(section), sort_keys=True) for s in saved.values()}
    if len(values) != 1:
        raise CheckpointError(f"checkpoint ranks disagree on {section} ({sorted(values)[:3]}); it is corrupt")
    return json.loads(values.pop())


def resharded_state(saved: Mapping[int, Mapping[str, Any]], mine: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """The skeleton rank `rank` loads: for each section of its own skeleton `mine`, its parameters' and units'
    entries from whichever saved rank wrote them (the fullest copy), the optimizer groups' settings, no work in
    flight, and the RNG of the saved rank of the same index when there was one. Call `work_in_flight` first:
    in-flight work does not follow the state."""
    out: dict[str, Any] = {}
    for section, value in mine.items():
        if section in KEYED_SECTIONS:
            merged = fullest_copies(section, {r: s[section] for r, s in saved.items()})
            out[section] = _pick(section, merged, value)
        elif section == "optimizer":
            out[section] = _resharded_optimizer({r: s[section] for r, s in saved.items()}, value)
        elif section in LOCAL_SECTIONS:
            out[section] = _emptied(value)
        else:
            out[section] = _agreed(section, saved)
    if rank in saved:
        out["rng"] = saved[rank]["rng"]
    return out
