"""`benchmarks.fragment_sizes` partitions published model shapes as the engine does (meta device, no download)."""

import pytest

from benchmarks import fragment_sizes


@pytest.mark.timeout(300)
def test_balanced_fragments_are_one_over_p_of_every_published_shape(capsys):
    fragment_sizes.main(["--num_fragments", "4", "--patterns", "strided", "balanced"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    peaks = {(row[0].lstrip("| "), row[2]): float(row[4].rstrip(" |x")) for row in rows}
    assert len(peaks) == 2 * len(fragment_sizes.SHAPES)
    for (model, pattern), peak in peaks.items():
        if pattern == "balanced":
            assert peak == 1.0, model
        else:
            assert peak > 1.05, model  # strided: fragment 0 holds every embedding on top of its blocks
    assert peaks[("bench model (benchmarks.comm)", "strided")] == 2.14
