"""The OpenAI-compatible gateway: agents written against the OpenAI API, trained on-policy.

A `workflow.program` ("module:function") is a plain async function that gets the episode's task and one
`openai.AsyncOpenAI` client per agent. Each env worker serves an HTTP gateway (`server.py`, aiohttp, on the
worker's own event loop; `http.py` its aiohttp runner) that answers `POST /v1/chat/completions`, `POST
/v1/completions`, `POST /v1/responses` (the Responses API, read as a chat request: `responses_api.py`) and
`GET /v1/models`, in JSON or as server-sent events (`streaming.py`): `model` names an agent, the per-episode API
key names the episode (`session.py`; after the run's token when the gateway is served outside the run to
an agent service, `access.py`), the request's fields are checked (`requests.py`, `completions.py`,
`sampling.py`), a chat prompt is rendered with the agent's policy's chat template and tools (`tools.py`)
reusing the exact token ids of earlier turns (`transcript.py`), and the request goes to the router as a
`Generate` like any other, so it gets the same balancing, update gate and version tags. The answer is
OpenAI's object plus the exact ids and weight version (`responses.py`), a reply's Hermes tool calls parsed
into `message.tool_calls`. Every call is recorded as the agent's turn; when the program returns, the
episode turns the calls into samples with the program's rewards (`episode.py`, `workflow.py`; the program
and scorer are loaded by `loading.py`, which the server imports, so the modules import one way). Under tree
sampling a training call is K candidates scored by the program's scorer, the best returned (`tree.py`).
The clients a program is given hand their plain calls to the gateway in-process, without HTTP, with the
same requests, replies and errors (`in_process.py`). docs/gateway.md is the user's guide.
"""
