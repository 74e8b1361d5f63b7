"""What a handler can do, by name: each capability decides which HTTP routes a server serves.

`generate` (OpenAI completions and chat), `embed` (`/v1/embeddings`), `classify` (`/v1/classify`),
`predict` (`POST /predict`, the body given to the handler's `decode` as it came). A leaf, so the
API's description can name them without loading any handler.
"""

from __future__ import annotations

GENERATE = "generate"
EMBED = "embed"
CLASSIFY = "classify"
PREDICT = "predict"
