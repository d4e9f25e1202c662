"""Errors for programs that XLA could only compile with a buffer copy."""


class CopyHazardError(ValueError):
  """A program whose buffers cannot alternate without an XLA copy.

  Raised at trace time, before XLA sees the program, when the scheduling
  helpers can tell that XLA's copy insertion would copy a buffer: at best a
  wasted read and write of the whole buffer, at worst (a buffer a transfer
  is still reading or writing) wrong results on TPU. The message says which
  value and what to change.
  """


class CopyHazardWarning(UserWarning):
  """A program XLA will compile with a (safe but wasted) buffer copy.

  Warned at trace time when the copy touches no buffer in flight, so the
  results are right but a full read and write of the buffer is added. The
  message says what to change to avoid it.
  """
