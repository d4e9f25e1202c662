"""Value API versus Ref API on the seed design's patterns."""

from asyncops.compare._patterns import PATTERNS as PATTERNS
from asyncops.compare._table import rows as rows
