-- A new Idempotency-Key on every request: "<prefix>-<thread>-<counter>".
-- Args (after --): prefix, method (POST|GET), path, host. A POST carries a small JSON body.
-- The request is two fixed strings around the counter, so wrk spends as little as possible
-- per request (wrk.format on every request would cost the client more than Envoy).
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "report.lua")

local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("id", threads)
end

local head, tail
local counter = 0
function init(args)
  local prefix = args[1] or "k"
  local method = args[2] or "POST"
  local path = args[3] or "/payments"
  local host = args[4] or "bench"
  local body = '{"amount":10}'
  -- Every request speaks for a caller: keys are scoped by Authorization.
  head = method .. " " .. path .. " HTTP/1.1\r\nHost: " .. host .. "\r\nAuthorization: Bearer bench\r\n"
  if method ~= "GET" then
    head = head .. "Content-Type: application/json\r\nContent-Length: " .. #body .. "\r\n"
  else
    body = ""
  end
  head = head .. "Idempotency-Key: " .. prefix .. "-" .. (id or 0) .. "-"
  tail = "\r\n\r\n" .. body
end

function request()
  counter = counter + 1
  return head .. counter .. tail
end
