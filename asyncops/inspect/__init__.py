"""HLO inspection harness: see what XLA did to async start/done kernels.

Example:

  >>> from asyncops.inspect import tpu_mesh, analyze
  >>> mesh = tpu_mesh("v5e:2x4", (2, 4), ("x", "y"))
"""

from ._analysis import analyze as analyze
from ._analysis import analyze_module as analyze_module
from ._guard import CopyHazardError as CopyHazardError
from ._guard import CopyHazardWarning as CopyHazardWarning
from ._guard import Hazard as Hazard
from ._guard import assert_copy_free as assert_copy_free
from ._guard import check_hlo as check_hlo
from ._guard import check_report as check_report
from ._guard import hazards as hazards
from ._hlo import Instr as Instr
from ._hlo import Module as Module
from ._hlo import parse_module as parse_module
from ._mesh import compile_tpu as compile_tpu
from ._mesh import quiet_stderr as quiet_stderr
from ._mesh import tpu_mesh as tpu_mesh
from ._mesh import tpu_topology as tpu_topology
from ._report import Copy as Copy
from ._report import Pair as Pair
from ._report import Report as Report
