"""What a cell reads from the notebook and what it binds on the ranks: the names that decide which
notebook values a session cell is sent (no processes here)."""

from __future__ import annotations

import ast

from nbdist.frontend.cell_source import find_defined_names, find_read_names

CELL = '''
import torch.nn as nn, os.path
from math import pi as PI
model = nn.Linear(2, 2)
for step in range(3):
    pass
with open(os.devnull) as fh:
    pass
try:
    pass
except ValueError as err:
    pass

def train(steps):
    global total
    for x in range(steps):
        loss = x * 2
    return [k for k in range(steps)]

class Net(nn.Module):
    width = 4
    def forward(self, inp):
        hidden = inp
        return hidden

square = lambda v: v * v
squares = [i * i for i in range(3)]
'''


def test_a_cell_binds_its_top_level_names_not_those_inside_its_functions():
    tree = ast.parse(CELL)
    assert find_defined_names(tree) == {"nn", "os", "PI", "model", "step", "fh", "err", "train", "total", "Net",
                                        "square", "squares"}


def test_a_cell_reads_names_anywhere_its_functions_included():
    reads = find_read_names(ast.parse("def f():\n    return SCALE * x\ny = f() + OFFSET\n"))
    assert {"SCALE", "x", "OFFSET", "f"} <= reads and "print" not in reads
