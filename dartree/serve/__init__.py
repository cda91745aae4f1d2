"""`dartree serve`: an OpenAI-compatible HTTP server around one long-lived SpeculativeDecoder.

    dartree serve --model tiny --port 8080
    client = openai.OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="none")
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])

Modules: `schema` (request fields, validated into a `DecodeRequest`), `text` (the answer's text as
tokens arrive, cut at stop strings), `worker` (the one decoder, fed from a bounded queue by one
thread), `responses` (OpenAI's response and chunk bodies, server-sent events), `app` (the
Starlette routes, API key, body limit, errors), `command` (`dartree serve`'s options; uvicorn).
Nothing here is imported by `import dartree`; `app` needs the `serve` extra (starlette, uvicorn).
"""
