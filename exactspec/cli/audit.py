"""`exactspec audit`: exact and statistical audit of every verifier and pitfall."""

from __future__ import annotations

from exactspec.cli.common import UsageError, bars, refuse_without, value_or


def add(sub) -> None:
    p = sub.add_parser(
        "audit", help="exact and statistical audit of every verifier and pitfall",
        description="Runs token, block and greedy verification on random, point-mass, "
        "zero-holding, disjoint and parameter-folded p/q, and every seed pitfall: exact TV "
        "distance of the first generated tokens from the target, and a chi-square test on "
        "batched samples. Exits 1 if a lossless method fails or a pitfall is missed.")
    p.add_argument("--seed", type=int, default=0, help="seed for the statistical samples")
    p.add_argument("--samples", type=int, default=None,
                   help="sequences drawn per case (default: AuditConfig.samples)")
    p.add_argument("--lossy", action="store_true",
                   help="instead: the drift and acceptance gain of each lossy verify rule "
                   "(lenient:L, typical:EPS) on the worlds and a tiny model, a table and a PNG")
    p.add_argument("--png", default=None,
                   help="with --lossy: where the plot goes (default lossy.png; '' to skip)")
    p.set_defaults(run=run)


def run(args) -> int:
    from exactspec import cli  # run_audit is looked up there, so tests can replace it
    from exactspec.audit import AuditConfig, format_table

    refuse_without(args, {"png": "--png"}, args.lossy, "--lossy")
    if args.lossy:
        return _run_lossy(args)
    samples = AuditConfig.samples if args.samples is None else args.samples
    if samples < 100:
        raise UsageError(f"--samples {samples} is too small; use at least 100")
    cfg = AuditConfig(seed=args.seed, samples=samples,
                      greedy_samples=min(AuditConfig.greedy_samples, samples))
    rows = cli.run_audit(cfg)
    print(format_table(rows, cfg))
    return 0 if all(row.ok for row in rows) else 1


def _run_lossy(args) -> int:
    from exactspec.audit.lossy import LossyConfig, format_lossy, plot_lossy, run_lossy

    if args.samples is not None and args.samples < 100:
        raise UsageError(f"--samples {args.samples} is too small; use at least 100")
    sizes = {} if args.samples is None else {"rows": args.samples}
    cfg = LossyConfig(seed=args.seed, **sizes)
    result = run_lossy(cfg, progress=bars())
    print(format_lossy(result, cfg))
    png = value_or(args, "png", "lossy.png")
    if png:
        print(f"plot: {plot_lossy(result, png)}")
    return 0 if all(abs(r.measured_tv - r.model_tv) <= r.bound for r in result) else 1
