"""`exactspec bench`: every engine on the shipped workloads, interleaved round by round.

Method: one warm-up call per engine, then for each round, mode, workload and prompt every
engine runs in turn (so a slow patch of a busy machine hits all engines alike). Per engine,
mode and workload: tokens/s per round (tokens / wall seconds, prefill included), median and
spread over rounds; ratios to exactspec plain and to the transformers counterpart taken from
the medians of the same run; acceptance, the fitted per-token acceptance rate alpha, the
measured cost ratio c and Leviathan's analytic bound (1 - a^(K+1)) / ((1 - a)(K c + 1)).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import resources

from tqdm.auto import tqdm

from exactspec.bench.engines import MODES, Engines, EngineSpec, Run, default_engines
from exactspec.bench.figures import bandwidth_summary, machine_info
from exactspec.bench.isolated import EngineCrashed
from exactspec.bench.rows import engine_row, merge_runs
from exactspec.bench.trees import compared, summarise, tree_engines, with_named
from exactspec.errors import InvalidValue
from exactspec.models.loading import Model

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1


@dataclass
class Workload:
    """Prompts of one kind, with the token budget every engine gets."""

    name: str  # "chat", "code_edit", ...
    description: str  # one line
    input_grounded: bool  # the answer copies much of the prompt
    max_new_tokens: int  # per prompt
    prompts: list[str]  # user turns, chat-templated before encoding
    # a long-prompt workload: each prompt followed by the shipped document (long_document.txt)
    # cut to about this many tokens of the target's tokenizer
    context_tokens: int | None = None
    default: bool = True  # run when no workload is named


def load_workloads() -> list[Workload]:
    """The workloads shipped in exactspec/bench/workloads.json; an entry with "prompt_tokens"
    becomes one workload per length, named <name>_<tokens> (e.g. long_prompt_1024)."""
    text = resources.files("exactspec.bench").joinpath("workloads.json").read_text()
    out = []
    for w in json.loads(text)["workloads"]:
        lengths = w.pop("prompt_tokens", None)
        if lengths is None:
            out.append(Workload(**w))
        else:
            out += [Workload(**{**w, "name": f"{w['name']}_{n}", "context_tokens": n,
                                "default": False}) for n in lengths]
    return out


def workload_names(workloads: list[Workload]) -> list[str]:
    """The names --workloads takes: each workload's, and each long-prompt family's."""
    return list(dict.fromkeys([w.name for w in workloads] + [
        w.name.rsplit("_", 1)[0] for w in workloads if w.context_tokens]))


def select_workloads(workloads: list[Workload], names: list[str] | None) -> list[Workload]:
    """The workloads named (a long-prompt family by its own name, e.g. long_prompt), or the
    default ones; an unknown name is an error naming the known ones."""
    if names is None:
        return [w for w in workloads if w.default]
    known = workload_names(workloads)
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise InvalidValue(f"unknown workloads {unknown}; have {known}")
    return [w for w in workloads if w.name in names
            or (w.context_tokens and w.name.rsplit("_", 1)[0] in names)]


def long_document() -> str:
    return resources.files("exactspec.bench").joinpath("long_document.txt").read_text()


@dataclass
class BenchConfig:
    """What one `exactspec bench` run measures."""

    quick: bool = False  # the smoke-check subset
    rounds: int = 2  # measured rounds (median over them); quick: 1
    modes: list[str] = field(default_factory=lambda: ["greedy", "t1", "t0.7p0.9"])
    draft_model_modes: list[str] = field(default_factory=lambda: ["greedy", "t1"])  # the slow
    # draft-model engines (exactspec draft *, transformers assisted) run in these modes only
    workloads: list[str] | None = None  # names; None = all shipped
    prompts_per_workload: int | None = 1  # first N prompts of each; None = all
    max_new_tokens: int | None = None  # overrides every workload's budget
    max_new_tokens_cap: int | None = 48  # caps every workload's budget but "long"'s
    long_max_new_tokens: int | None = 96  # caps the "long" workload's budget
    k: int = 4  # fixed draft length of the K engines
    sweep_ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])  # speedup vs K
    sweep_workload: str = "code_edit"  # greedy, the sweep's workload
    # bench words (bench/engine_names.py's BenchUse) of the sweep's engines
    sweep_drafters: list[str] = field(default_factory=lambda: ["lookup", "draft", "eagle",
                                                               "qdraft int8"])
    block: bool = True  # include the block-verification engines (sampling modes only)
    batch_rows: int = 8  # rows of the batched comparison (0 = skip)
    batch_max_new_tokens: int = 48  # per row in the batched comparison
    draft_layers: int = 4  # truncated-target draft model: its first N layers
    engines: list[str] | None = None  # keep engines whose name contains one of these
    qk: int = 6  # fixed draft length of the quantized self-draft engines
    # the tree-vs-chain comparison (bench/trees.py) instead of the default engines; no K sweep
    # and no batch then (the comparison sweeps the verify width itself)
    trees: bool = False
    width_cost_context: int = 300  # cached tokens when probing w(N+1) for the tree table
    width_cost_repeats: int = 9  # timed forwards per width of that probe (median)

    @classmethod
    def quick_config(cls) -> BenchConfig:
        return cls(quick=True, rounds=1, modes=["greedy", "t1"],
                   workloads=["chat", "code_edit", "summarise"], prompts_per_workload=1,
                   max_new_tokens=32, sweep_ks=[2, 8], sweep_drafters=["lookup"],
                   block=False, batch_max_new_tokens=24)


class Bench:
    """Runs the comparison for one target; `run()` returns the JSON-ready result dict (on
    Ctrl-C, with "interrupted": True and what was measured so far)."""

    def __init__(self, target: Model, cfg: BenchConfig, *, engines: list[EngineSpec] | None = None,
                 draft=None, draft_note: str = "", eagle_factory: Callable[[], object] | None = None,
                 workloads: list[Workload] | None = None, progress: bool = True,
                 sources: dict[str, object] | None = None) -> None:
        self.target = target
        self.cfg = cfg
        # sources: the source of each registry drafter that takes one (Engines)
        self.runner = Engines(target, draft, eagle_factory, sources)
        if engines is None:
            engines = tree_engines() if cfg.trees else default_engines(
                cfg.k, eagle=eagle_factory is not None, block=cfg.block, qk=cfg.qk)
        specs = with_named(engines, cfg.engines)  # + trees and chains asked for by name
        unknown = [e for e in cfg.engines or [] if not any(e in s.name for s in specs)]
        if unknown:
            raise InvalidValue(f"no engine is named {unknown}; names are "
                               f"{[s.name for s in specs]}, or spell a tree or chain as "
                               "'eagle tree 4,1,1,1', 'lookup tree 3x4', 'eagle K=16'")
        asked = [s for s in specs if cfg.engines is None or any(e in s.name for e in cfg.engines)]
        self.specs = [s for s in asked if self.runner.available(s)]
        # engine -> why its rows are missing: llama.cpp unusable here (asked for, not run) ...
        self.left_out = {s.name: why for s in asked if (why := self.runner.why_not(s))}
        self.crashed: dict[str, str] = {}  # ... or its child process crashed (bench/isolated)
        if not self.specs:
            raise InvalidValue(f"no engine matches {cfg.engines}; names are "
                             f"{[s.name for s in specs]}")
        self.draft_note = draft_note
        self.progress = progress
        self.workloads = select_workloads(
            workloads if workloads is not None else load_workloads(), cfg.workloads)
        bad = [m for m in cfg.modes if m not in MODES]
        if bad:
            raise InvalidValue(f"unknown modes {bad}; have {list(MODES)}")
        self._ids: dict[str, list[int]] = {}
        self._read_gbs: float | None = None  # measured once the runs are done

    def _encode(self, prompt: str) -> list[int]:
        if prompt not in self._ids:
            self._ids[prompt] = self.target.encode(prompt, chat=True)
        return self._ids[prompt]

    def _prompts(self, w: Workload) -> list[str]:
        n = self.cfg.prompts_per_workload
        prompts = w.prompts[:n] if n else w.prompts
        if not w.context_tokens:
            return prompts
        # the document cut to the tokens left after the prompt and the chat template
        doc = self.target.encode(long_document(), chat=False)
        out = []
        for p in prompts:
            room = w.context_tokens - len(self.target.encode(p + "\n\n", chat=True))
            if room > len(doc):
                raise InvalidValue(f"workload {w.name}: the shipped document has {len(doc)} "
                                   f"tokens of this tokenizer, fewer than {room}")
            out.append(p + "\n\n" + self.target.tokenizer.decode(doc[:max(room, 0)]))
        return out

    def _budget(self, w: Workload) -> int:
        cfg = self.cfg
        if cfg.max_new_tokens:
            return cfg.max_new_tokens
        cap = cfg.long_max_new_tokens if w.name == "long" else cfg.max_new_tokens_cap
        return min(w.max_new_tokens, cap) if cap else w.max_new_tokens

    def _jobs(self) -> list[tuple]:
        """(round, mode, workload, prompt index, spec) in execution order."""
        jobs = []
        for r in range(self.cfg.rounds):
            for mode in self.cfg.modes:
                for w in self.workloads:
                    for i in range(len(self._prompts(w))):
                        for s in self.specs:
                            if s.sampling_only and mode == "greedy":
                                continue
                            if s.drafter == "draft" and mode not in self.cfg.draft_model_modes:
                                continue
                            jobs.append((r, mode, w, i, s))
        return jobs

    def run(self) -> dict:
        cfg = self.cfg
        start = time.perf_counter()
        jobs = self._jobs()
        sweep = [] if cfg.trees else self._sweep_specs()
        batch = self._batch_specs() if cfg.batch_rows and not cfg.trees else []
        total = len(self.specs) + len(jobs) + len(sweep) * cfg.rounds + len(batch) * cfg.rounds
        bar = tqdm(total=total, desc="bench", unit="run", disable=not self.progress)
        runs: dict[tuple[str, str, str], list[list[Run]]] = {}
        sweep_runs: dict[str, list[Run]] = {}
        batch_runs: dict[str, list[Run]] = {}
        interrupted = False  # Ctrl-C: summarise the runs measured so far
        try:
            warm = self._encode(self.workloads[0].prompts[0])
            for s in self.specs:  # warm-up: first calls pay for allocation and lazy init
                bar.set_postfix_str(f"warm-up {s.name}")
                self._run(s, [warm], MODES["greedy"], 8, seed=0)
                bar.update()
            for r, mode, w, i, s in jobs:
                bar.set_postfix_str(f"{mode} {w.name} {s.name}")
                run = self._run(s, [self._encode(self._prompts(w)[i])], MODES[mode],
                                self._budget(w), seed=1000 * r + i)
                bar.update()
                if run is None:
                    continue
                per_round = runs.setdefault((s.name, mode, w.name), [])
                while len(per_round) <= r:
                    per_round.append([])
                per_round[r].append(run)
            sweep_runs = self._run_group(sweep, self._sweep_prompts(), bar, "sweep")
            batch_runs = self._run_group(batch, self._batch_prompts(), bar, "batch")
        except KeyboardInterrupt:
            interrupted = True
        finally:
            bar.close()
        bandwidth = bandwidth_summary(self.target.model, runs)
        self._read_gbs = bandwidth["read_gbs"]
        summary = self._summarise(runs)
        result = {
            "schema": SCHEMA_VERSION,
            "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": machine_info(),
            "bandwidth": bandwidth,
            "model": self.target.name,
            "config": asdict(cfg),
            "draft_note": self.draft_note,
            "engines": [asdict(s) for s in self.specs],
            "results": summary,
            "sweep": self._summarise_group(sweep, sweep_runs, "sweep"),
            "batch": self._summarise_group(batch, batch_runs, "batch"),
            "trees": None if interrupted else self._trees(summary),
            # a long-prompt workload's prompt length in tokens (its first prompt)
            "prompt_tokens": {w.name: len(self._encode(self._prompts(w)[0]))
                              for w in self.workloads if w.context_tokens},
            "left_out": self.left_out,  # engine -> why it did not run here
            "crashed": self.crashed,  # engine -> how its child process died (rows lost)
        }
        result["duration_seconds"] = time.perf_counter() - start
        result["interrupted"] = interrupted
        return result

    def _trees(self, rows: list[dict]) -> dict | None:
        """The tree-vs-chain table (bench/trees.py) when a tree engine ran: w probed at widths
        1 .. the widest compared one with width_cost.time_widths, then the pooled rows."""
        specs = compared(self.specs)
        if not any(s.tree for s in specs):
            return None
        from exactspec.bench.width_cost import time_widths
        from exactspec.models.adapter import TargetAdapter

        # every width up to the widest: a chain's mean scored width falls between them
        widths = list(range(1, max(s.verify_width or 1 for s in specs) + 1))
        adapter = TargetAdapter(self.target.model)
        context = max(1, min(self.cfg.width_cost_context, adapter.max_context - widths[-1] - 1))
        ms = time_widths(adapter, widths, 1, context, self.cfg.width_cost_repeats)
        grounded = {w.name: w.input_grounded for w in self.workloads}
        return {"width_cost": {"context": context, "batch": 1, "ms": ms,
                               "w": {k: v / ms[1] for k, v in ms.items()}},
                "rows": summarise(specs, rows, grounded, ms)}

    # --- sweep (speedup against K) and batch (8 rows at once) --------------------------------

    def _run(self, spec: EngineSpec, prompts, mode, max_new_tokens: int, seed: int):
        """One run of `spec`; None once its engine has crashed (that engine's rows are lost,
        logged once and listed in the result's "crashed")."""
        if spec.name in self.crashed:
            return None
        try:
            return self.runner.run(spec, prompts, mode, max_new_tokens, seed)
        except EngineCrashed as e:
            self.crashed[spec.name] = str(e)
            log.warning("%s; its rows are left out, the other engines go on", e)
            return None

    def _sweep_specs(self) -> list[EngineSpec]:
        if not self.cfg.sweep_ks or self.cfg.sweep_workload not in {w.name for w in self.workloads}:
            return []
        out = [EngineSpec("exactspec plain", "exactspec", "none")]
        for d in self.cfg.sweep_drafters:
            for k in self.cfg.sweep_ks:
                out.append(EngineSpec(f"exactspec {d} K={k}", "exactspec", d, k))
        return self._selected(out)

    def _sweep_prompts(self) -> list[list[list[int]]]:
        w = next((w for w in self.workloads if w.name == self.cfg.sweep_workload), None)
        return [] if w is None else [[self._encode(p)] for p in self._prompts(w)]

    def _batch_specs(self) -> list[EngineSpec]:
        k = self.cfg.k
        out = [EngineSpec("exactspec plain", "exactspec", "none"),
               EngineSpec(f"exactspec lookup K={k}", "exactspec", "lookup", k),
               EngineSpec("exactspec lookup auto", "exactspec", "lookup", "auto")]
        out += [EngineSpec("exactspec eagle K=4", "exactspec", "eagle", k),
                EngineSpec(f"exactspec qdraft int8 K={self.cfg.qk}", "exactspec",
                           "qdraft int8", self.cfg.qk),
                EngineSpec("exactspec qdraft int8 auto", "exactspec", "qdraft int8", "auto")]
        return self._selected(out)

    def _selected(self, specs: list[EngineSpec]) -> list[EngineSpec]:
        """The available specs that --engines keeps (plain always: ratios need it)."""
        keep = self.cfg.engines
        return [s for s in specs if self.runner.available(s) and (
            keep is None or s.drafter == "none" or any(e in s.name for e in keep))]

    def _batch_prompts(self) -> list[list[list[int]]]:
        # rows from every selected workload in turn (open-ended and input-grounded mixed)
        pool = [p for w in self.workloads for p in w.prompts]  # (a long-prompt workload: its instruction alone)
        rows = [self._encode(pool[i % len(pool)]) for i in range(self.cfg.batch_rows)]
        return [rows]

    def _run_group(self, specs, prompt_sets, bar, label) -> dict[str, list[Run]]:
        out: dict[str, list[Run]] = {}
        if not specs:
            return out
        budget = self.cfg.batch_max_new_tokens if label == "batch" else None
        w = next((w for w in self.workloads if w.name == self.cfg.sweep_workload), None)
        for r in range(self.cfg.rounds):
            for s in specs:
                bar.set_postfix_str(f"{label} {s.name}")
                merged = None
                for i, prompts in enumerate(prompt_sets):
                    n = budget or (self._budget(w) if w else 32)
                    run = self._run(s, prompts, MODES["greedy"], n, seed=1000 * r + i)
                    if run is None:
                        break
                    merged = run if merged is None else merge_runs(merged, run)
                bar.update()
                if run is not None:
                    out.setdefault(s.name, []).append(merged)
        return out

    def _summarise_group(self, specs, runs: dict[str, list[Run]], label: str) -> list[dict]:
        rows = []
        plain = runs.get("exactspec plain")
        for s in specs:
            rs = runs.get(s.name, [])
            if not rs:
                continue
            rows.append(engine_row(s, "greedy", self.cfg.sweep_workload if label == "sweep" else
                                  "batch", [[r] for r in rs], [[r] for r in plain or []],
                                  **self._bandwidth_args(s)))
        return rows

    # --- figures -----------------------------------------------------------------------------

    def _bandwidth_args(self, spec: EngineSpec) -> dict:
        """engine_row's weight_bytes and read_gbs for `spec` (the bandwidth column)."""
        return {"weight_bytes": self.runner.weight_bytes(spec), "read_gbs": self._read_gbs}

    def _summarise(self, runs: dict[tuple[str, str, str], list[list[Run]]]) -> list[dict]:
        rows = []
        for mode in self.cfg.modes:
            for w in self.workloads:
                plain = runs.get(("exactspec plain", mode, w.name))
                for s in self.specs:
                    rounds = runs.get((s.name, mode, w.name))
                    if rounds:
                        rows.append(engine_row(s, mode, w.name, rounds, plain,
                                               **self._bandwidth_args(s)))
        by_key = {(r["engine"], r["mode"], r["workload"]): r for r in rows}
        for r in rows:
            spec = next(s for s in self.specs if s.name == r["engine"])
            other = by_key.get((spec.counterpart, r["mode"], r["workload"]))
            r["counterpart"] = spec.counterpart
            r["ratio_to_counterpart"] = (r["tokens_per_second"] / other["tokens_per_second"]
                                         if other and other["tokens_per_second"] else None)
        return rows
