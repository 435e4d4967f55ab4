"""`python -m exactspec.bench.products`: every format and row count on a tiny shape (it reports,
it asserts no speed), and bad arguments named."""

from __future__ import annotations

import pytest

from exactspec import kernels
from exactspec.bench import products


def test_every_format_and_row_count_is_reported(capsys):
    if not kernels.enabled():
        pytest.skip("the exactspec kernels are not built here")
    products.main(["--threads", "1", "--rows", "1,3", "--repeats", "1",
                   "--shape", "64,96,2,1,32,2,100"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("9 products")  # 4 a layer x 2 layers + the head
    lines = [line for line in out[1:] if "rows" in line]
    assert [(line.split()[0], int(line.split()[2][:-1])) for line in lines] == [
        (f, m) for f in products.FORMATS for m in (1, 3)]
    assert all("GB/s" in line and " w " in line for line in lines)


@pytest.mark.parametrize("args", [["--formats", "int3"], ["--rows", "one"],
                                  ["--shape", "1,2,3"]])
def test_bad_arguments_are_named(args, capsys):
    with pytest.raises(SystemExit):
        products.main(args)
    assert "--" in capsys.readouterr().err
