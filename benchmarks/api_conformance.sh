#!/usr/bin/env bash
# schemathesis against `compiled-llm serve tiny-qwen2` on 127.0.0.1, with and without --api-key:
# every response must be one the server's /openapi.json lists (status and content type), none a
# 5xx, and a 405 must carry Allow. schemathesis is not a project dependency: `pip install
# schemathesis` first (checked with 4.32). On 2 CPU cores it takes about 5 minutes.
#   bash benchmarks/api_conformance.sh                 # EXAMPLES=100 per operation and run
#   EXAMPLES=20 SEED=3 bash benchmarks/api_conformance.sh
# Exits non-zero when a run finds a failure. The in-suite counterpart, without schemathesis, is
# tests/serve/openai/test_server.py::test_each_response_is_one_the_openapi_document_lists.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
EXAMPLES=${EXAMPLES:-100}
SEED=${SEED:-1}
WORK=$(mktemp -d)
# the checks of what the document promises; not negative_data_rejection / positive_data_acceptance,
# which judge how strict the request schemas are, not whether the document tells the truth
CHECKS=not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance,unsupported_method,allow_header_conformance,missing_required_header,ignored_auth
export COMPILED_LLM_CACHE_DIR=$WORK/cache  # the engine this builds goes away with the run
python -m compiled_llm.cli.main build tiny-qwen2 -o "$WORK/engine" --device cpu --dtype float32 >/dev/null || exit 1

SERVER=
stop_server() {
  if [ -n "$SERVER" ]; then kill -TERM "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null; SERVER=; fi
}
trap 'stop_server; rm -rf "$WORK"' EXIT

start_server() {  # start_server PORT FLAGS...: returns once /health answers
  local port=$1; shift
  python -m compiled_llm.cli.main serve "$WORK/engine" --device cpu --host 127.0.0.1 --port "$port" \
    --enable-tokenizer-info-endpoint "$@" >"$WORK/serve-$port.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 300); do
    curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health" 2>/dev/null | grep -q 200 && return 0
    kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/serve-$port.log"; return 1; }
    sleep 0.2
  done
  echo "the server did not answer /health"; return 1
}

run() {  # run NAME PORT [schemathesis options...]
  local name=$1 port=$2; shift 2
  echo "=== $name ==="
  schemathesis run "http://127.0.0.1:$port/openapi.json" --checks "$CHECKS" -n "$EXAMPLES" --seed "$SEED" \
    --workers 1 --request-timeout 120 --generation-database none --no-color --report-dir "$WORK/report" "$@" \
    | tail -25
}

status=0
PORT=$((20000 + RANDOM % 20000))
start_server "$PORT" || exit 1
run "no API key" "$PORT" || status=1
stop_server
PORT=$((PORT + 1))
start_server "$PORT" --api-key conformance-key || exit 1
run "--api-key, with the key" "$PORT" -H "Authorization: Bearer conformance-key" || status=1
run "--api-key, without it" "$PORT" || status=1
exit $status
