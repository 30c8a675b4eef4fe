"""The memory planner against what a finished run logged: ``memory/<role>-{parameters,gradients,optimizer,frozen}
_bytes`` of its last record, from DP rank 0."""

# The planner's exact figures must agree with a run's within this share (issue 19: 5%).
AGREEMENT = 0.05


def planned_and_logged(argv: list[str], records: list[dict]) -> dict[str, tuple[int, int]]:
    """``{"<role>-<name>": (planned bytes, logged bytes)}`` for the run of ``argv`` whose metrics are ``records``."""
    from miles.driver.arguments import parse_args
    from miles.driver.memory_plan import plan_run

    _, plans = plan_run(parse_args(argv))
    logged = [record for record in records if any(key.startswith("memory/") for key in record)][-1]
    return {
        f"{plan.role}-{name}": (planned, logged[f"memory/{plan.role}-{name}_bytes"])
        for plan in plans
        for name, planned in plan.logged().items()
    }


def assert_plan_agrees(argv: list[str], records: list[dict]) -> dict[str, tuple[int, int]]:
    """Every planned figure within :data:`AGREEMENT` of the logged one (a figure logged as 0 must be planned 0)."""
    figures = planned_and_logged(argv, records)
    for key, (planned, logged) in figures.items():  # shown with pytest -s: the figures docs/performance.md quotes
        print(f"memory plan {key}: planned {planned} B, logged {logged} B")
    off = {key: pair for key, pair in figures.items() if abs(pair[0] - pair[1]) > AGREEMENT * pair[1]}
    assert not off, f"planned vs logged bytes off by more than {AGREEMENT:.0%}: {off} (all: {figures})"
    return figures
