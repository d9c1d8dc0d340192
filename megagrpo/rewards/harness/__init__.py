"""Programs that run inside the sandbox (sent there as text; they import only the standard
library and each other): `wire` (frames and plain data), `trusted` (the test interpreter),
`solution` (the interpreter of the model's code)."""
