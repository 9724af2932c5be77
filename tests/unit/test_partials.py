"""Per-node partial reductions merged into the summary (issue 24): the merged summary equals a
single pass over the rank files (exact fields bit for bit, and the approximate quantiles too,
since both add the same sketches), a missing or stale partial falls back to the rank files with
a note, and approximate quantiles stay within their stated bound of the exact ones."""

import random
import shutil
from datetime import datetime, timezone

import orjson
import pytest

from traceml import schema
from traceml.analysis import stats
from traceml.analysis.partials import partial_path, reduce_node
from traceml.analysis.reduce import reduce_run

from rankfiles import footer, header, step, write_rank

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)
NODES, RANKS_PER_NODE = 3, 2
WARMUP = 5


def write_layout(
    run_dir, steps: int = 3000, seed: int = 1, nodes: int = NODES, per_node: int = RANKS_PER_NODE
) -> None:
    """nodes x per_node ranks with skewed step times; rank 3 abandoned one step."""
    rng = random.Random(seed)
    world = nodes * per_node
    for rank in range(world):
        node = rank // per_node
        records = [
            header(
                rank,
                world,
                node_rank=node,
                local_rank=rank % per_node,
                local_world_size=per_node,
                host=f"node{node}",
            )
        ]
        t = 0.0
        index = 0
        for number in range(1, steps + 1):
            if rank == 3 and number == 100:
                continue
            record = step(
                index,
                t,
                input=rng.expovariate(1.0),
                forward=10 + rng.gauss(0, 1),
                backward=20 + rng.lognormvariate(0, 0.7),
                optimizer=3.0,
                residual=rng.uniform(0, 2),
                comm_backward=rng.uniform(0, 5),
            )
            record[schema.GLOBAL_STEP] = number
            t += record[schema.STEP] + 0.5
            records.append(record)
            index += 1
        records.append(footer(index))
        write_rank(run_dir, rank, records)


def single_pass(run_dir, tmp_path):
    copy = tmp_path / "single"
    shutil.copytree(run_dir / "ranks", copy / "ranks")
    summary = reduce_run(copy, thresholds={"warmup_steps": WARMUP}, now=NOW)
    summary.pop(schema.SUMMARY_RUN_DIR)
    return summary


def merged(run_dir, jobs: int = 1):
    summary = reduce_run(run_dir, thresholds={"warmup_steps": WARMUP}, now=NOW, jobs=jobs)
    summary.pop(schema.SUMMARY_RUN_DIR)
    return summary


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("layout")
    write_layout(run_dir)
    return run_dir


def test_merged_partials_equal_a_single_pass(layout, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(layout / "ranks", run_dir / "ranks")
    for node in range(NODES):
        assert reduce_node(run_dir, node, WARMUP) == partial_path(run_dir, node)
    expected = single_pass(run_dir, tmp_path)
    assert expected[schema.SUMMARY_APPROXIMATE]  # 3000 steps a rank: sketches in play
    result = merged(run_dir)
    assert result == expected  # every field, exact and approximate, bit for bit
    assert not any("partial" in note for note in result[schema.SUMMARY_NOTES])
    # The partials are what was merged: small next to the rank files they stand for.
    partial_bytes = sum(partial_path(run_dir, n).stat().st_size for n in range(NODES))
    rank_bytes = sum(p.stat().st_size for p in (run_dir / "ranks").iterdir())
    assert partial_bytes < rank_bytes / 2


def test_a_missing_partial_falls_back_to_the_rank_files_with_a_note(layout, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(layout / "ranks", run_dir / "ranks")
    reduce_node(run_dir, 0, WARMUP)
    reduce_node(run_dir, 2, WARMUP)  # node 1 died before reducing
    expected = single_pass(run_dir, tmp_path)
    result = merged(run_dir, jobs=2)
    notes = result.pop(schema.SUMMARY_NOTES)
    assert any("node 1" in n and "rank files were read" in n for n in notes)
    expected.pop(schema.SUMMARY_NOTES)
    assert result == expected


def test_a_stale_or_damaged_partial_is_not_trusted(layout, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(layout / "ranks", run_dir / "ranks")
    for node in range(NODES):
        reduce_node(run_dir, node, WARMUP)
    # Rank 1's file grew after node 0 reduced it (a late flush); node 2's partial is damaged.
    with open(run_dir / "ranks" / "rank_1.jsonl", "ab") as handle:
        handle.write(orjson.dumps({"kind": "event", "level": "info", "code": "note"}) + b"\n")
    partial_path(run_dir, 2).write_bytes(b'{"schema": "traceml.partial/1.0", "parts": [')
    expected = single_pass(run_dir, tmp_path)
    result = merged(run_dir)
    notes = result.pop(schema.SUMMARY_NOTES)
    assert any("node_0.json: rank 1's file changed" in n for n in notes)
    assert any("node_2.json: unreadable" in n for n in notes)
    expected.pop(schema.SUMMARY_NOTES)
    assert result == expected
    # Another warm-up than the partials were made with: none is trusted.
    other = reduce_run(run_dir, thresholds={"warmup_steps": WARMUP + 1}, now=NOW)
    assert sum("another warm-up" in n for n in other[schema.SUMMARY_NOTES]) == 2


def test_a_partial_with_a_damaged_figure_is_not_trusted(tmp_path):
    # Keys and stamps intact, a string for a number: the merge's arithmetic crashed (exit 70).
    run_dir = tmp_path / "run"
    write_layout(run_dir, steps=40)
    for node in range(NODES):
        reduce_node(run_dir, node, WARMUP)
    partial = orjson.loads(partial_path(run_dir, 1).read_bytes())
    partial["parts"][0]["entry"]["phases"]["step_ms"]["sum"] = "12"
    partial_path(run_dir, 1).write_bytes(orjson.dumps(partial))
    expected = single_pass(run_dir, tmp_path)
    result = merged(run_dir)
    notes = result.pop(schema.SUMMARY_NOTES)
    assert any(
        "node_1.json: a part's figures are not numbers; that node's rank files were read" in n
        for n in notes
    )
    expected.pop(schema.SUMMARY_NOTES)
    assert result == expected


# Layouts where nodes compress their sketches: 5 ranks of a node pass COMPRESS_AT; and every
# complete node's approximate sketches become one (NodeSketches.finish).
COMPRESSING = [(2, 5, 2500), (10, 2, 2500)]


@pytest.mark.parametrize(
    ("nodes", "per_node", "steps"), [(NODES, RANKS_PER_NODE, 3000), *COMPRESSING]
)
def test_approximate_quantiles_are_within_their_stated_bound(tmp_path, nodes, per_node, steps):
    write_layout(tmp_path, steps, seed=nodes, nodes=nodes, per_node=per_node)
    summary = reduce_run(tmp_path, thresholds={"warmup_steps": WARMUP}, now=NOW, jobs=2)
    exactness = summary[schema.SUMMARY_EXACTNESS]
    bound = exactness["quantile_rank_error"]
    assert bound == stats.QUANTILE_RANK_ERROR and exactness["approximate"]
    pooled: dict[str, list[float]] = {}
    for path in sorted((tmp_path / "ranks").iterdir()):
        steps = [
            r for r in map(orjson.loads, path.read_bytes().splitlines()) if r["kind"] == "step"
        ][WARMUP:]
        for field in (schema.STEP, schema.INPUT_WAIT, schema.BACKWARD):
            pooled.setdefault(field, []).extend(r[field] for r in steps)
    for field, values in pooled.items():
        values.sort()
        described = summary["overall"]["phases"][field]
        assert described["count"] == len(values)
        assert described["sum"] == pytest.approx(sum(values), rel=1e-12)  # exact
        assert (described["min"], described["max"]) == (values[0], values[-1])
        distribution = summary["overall"]["distributions"][field]
        for p, value in [(0.5, described["median"]), (0.9, described["p90"])] + [
            (i / 1000, distribution[i]) for i in range(0, 1001, 25)
        ]:
            low = stats.quantile_sorted(values, max(0.0, p - bound))
            high = stats.quantile_sorted(values, min(1.0, p + bound))
            assert low - 1e-6 <= value <= high + 1e-6, (field, p)


@pytest.mark.parametrize(("nodes", "per_node", "steps"), COMPRESSING)
def test_merged_equals_single_pass_where_nodes_compress_their_sketches(
    tmp_path, nodes, per_node, steps
):
    run_dir = tmp_path / "run"
    write_layout(run_dir, steps, seed=nodes, nodes=nodes, per_node=per_node)
    expected = single_pass(run_dir, tmp_path)
    for node in range(nodes):
        reduce_node(run_dir, node, WARMUP)
    assert merged(run_dir) == expected


def test_node_zero_reduces_its_own_node_waits_for_the_others_then_merges(layout, tmp_path):
    from traceml.finalize import summarise_nodes

    run_dir = tmp_path / "run"
    shutil.copytree(layout / "ranks", run_dir / "ranks")
    thresholds = {"warmup_steps": WARMUP}
    reduce_node(run_dir, 1, WARMUP)  # node 2 never reduces (it died)
    summary, _text = summarise_nodes(run_dir, NODES, 0.2, thresholds=thresholds, write=False)
    assert partial_path(run_dir, 0).exists()
    notes = summary[schema.SUMMARY_NOTES]
    assert any("node 2" in n and "rank files were read" in n for n in notes)
    assert not any("node 0" in n or "node 1" in n for n in notes if "partial" in n)
    expected = single_pass(run_dir, tmp_path)
    for result in (summary, expected):
        result.pop(schema.SUMMARY_NOTES), result.pop(schema.SUMMARY_VERDICTS, None)
        result.pop(schema.SUMMARY_RUN_DIR, None), result.pop(schema.SUMMARY_GENERATED_AT)
    assert summary == expected


def test_a_direct_launchs_node_leader_reduces_its_node_in_a_child(layout, tmp_path):
    """What a direct launch's local rank 0 on node 1 runs at exit: the child command (the
    training process itself never loads the reducer)."""
    import subprocess
    from types import SimpleNamespace

    from traceml.capture.run_end import node_partial_command

    run_dir = tmp_path / "run"
    shutil.copytree(layout / "ranks", run_dir / "ranks")
    settings = SimpleNamespace(run_dir=run_dir, thresholds={"warmup_steps": WARMUP})
    command = node_partial_command(settings, 1)
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    partial = orjson.loads(partial_path(run_dir, 1).read_bytes())
    assert sorted(map(int, partial["files"])) == [2, 3]
    assert partial[schema.SUMMARY_WARMUP] == WARMUP  # the report's warm-up: it will merge it
    missing = subprocess.run(
        node_partial_command(SimpleNamespace(run_dir=run_dir), 7),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert missing.returncode == 1 and "node 7 wrote no rank file" in missing.stderr


def test_quantiles_taken_in_worker_processes_are_the_same(layout, monkeypatch):
    from traceml.analysis import node_sketches

    alone = reduce_run(layout, thresholds={"warmup_steps": WARMUP}, now=NOW, jobs=1)
    monkeypatch.setattr(node_sketches, "PARALLEL_POINTS", 0)  # a pool for every run
    pooled = reduce_run(layout, thresholds={"warmup_steps": WARMUP}, now=NOW, jobs=2)
    assert pooled == alone


def _node(rank_spans: list[range], seed: int):
    from traceml.analysis.node_series import NodeSeries

    rng = random.Random(seed)
    node = NodeSeries()
    for span in rank_spans:
        numbers = list(span)
        node.add(
            {
                "n": numbers,
                schema.STEP: [rng.uniform(1, 9) for _ in numbers],
                schema.FORWARD: [rng.uniform(1, 3) for _ in numbers],
            },
            "n",
        )
    return node


def test_merging_stored_node_series_shortcuts_nothing_that_counts():
    # Nodes as partials store them (uniform counts as one number), merged in order, against
    # the same nodes with their counts spelled out step by step: same totals, same counts.
    from traceml.analysis.node_series import NodeSeries

    layouts = [
        [range(0, 100), range(0, 100)],  # uniform
        [range(0, 100)] * 3,  # uniform, same span
        [range(50, 150)],  # another span
        [range(0, 100), range(0, 60)],  # counts differ along the steps
        [range(0, 100)],
    ]
    nodes = [NodeSeries.from_state(_node(spans, i).to_state()) for i, spans in enumerate(layouts)]
    assert set(nodes[0].uniform) == {schema.STEP, schema.FORWARD} and not nodes[3].uniform
    for order in (nodes, nodes[:2], [nodes[0], nodes[1], nodes[4]]):
        fast, slow = NodeSeries(), NodeSeries()
        for node in order:
            fast.merge(node)
            spelled = NodeSeries.from_state(node.to_state())
            spelled.uniform.clear()
            slow.merge(spelled)
        assert fast.counts == slow.counts and fast.totals == slow.totals
        assert fast.job_values() == slow.job_values()
    assert fast.uniform == {schema.STEP: 6, schema.FORWARD: 6}  # the last order: one span


@pytest.mark.parametrize("damage", ["sketches", "timeline", "telemetry"])
def test_a_partial_with_a_damaged_structure_is_not_trusted(tmp_path, damage):
    # Stamps intact, a string where the merge reads a dict: exit 70 (review, stop 59).
    run_dir = tmp_path / "run"
    write_layout(run_dir, steps=40)
    for node in range(NODES):
        reduce_node(run_dir, node, WARMUP)
    partial = orjson.loads(partial_path(run_dir, 1).read_bytes())
    part = partial["parts"][0]
    if damage == "sketches":
        part["sketches"] = "x"
    else:
        part["entry"][damage] = "x"
    partial_path(run_dir, 1).write_bytes(orjson.dumps(partial))
    notes = merged(run_dir)[schema.SUMMARY_NOTES]
    assert any("node_1.json: a part's figures are not numbers" in n for n in notes), notes
