"""``python -m asyncops.compare [topology]``: value API versus Ref API."""

import sys

from asyncops.compare._table import main

main(*sys.argv[1:2])
