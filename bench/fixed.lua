-- The same request every time (static: wrk formats it once).
-- Args (after --): key, path, host. A POST with the same JSON body as unique.lua.
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "report.lua")

function init(args)
  wrk.method = "POST"
  wrk.path = args[2] or "/payments"
  wrk.body = '{"amount":10}'
  wrk.headers["Host"] = args[3] or "bench"
  wrk.headers["Content-Type"] = "application/json"
  wrk.headers["Authorization"] = "Bearer bench" -- keys are scoped by Authorization
  wrk.headers["Idempotency-Key"] = args[1] or "fixed"
end
