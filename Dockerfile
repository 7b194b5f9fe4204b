FROM scratch
COPY dist/idempotency.wasm /plugin.wasm
