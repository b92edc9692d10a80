-- Argo CD health of a Switchyard NodeProxy (switchyard.dev/v1alpha1), one per node.
-- Uses only Lua's base functions (Argo CD runs health scripts without the standard libraries).
--   Progressing: no agent report yet, the agent starting, or a switch under way
--   Degraded:    the agent cannot serve (phase Failed), Healthy=False, or the last switch asked
--                for by the operator (this rolloutToken) was rolled back or failed
--   Healthy:     the agent serves (phase Active) in the desired mode, or the node is handed to
--                another service proxy (mode external) and the agent's rules are gone
local hs = { status = "Progressing", message = "Waiting for the node's agent to report" }

local function condition(conditions, kind)
  if conditions == nil then
    return nil
  end
  for _, c in ipairs(conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

if obj.status == nil then
  return hs
end
local status = obj.status
local spec = obj.spec
if spec == nil then
  spec = {}
end
local healthy = condition(status.conditions, "Healthy")
local last = status.lastSwitch

if status.phase == "Failed" then
  hs.status = "Degraded"
  hs.message = "The agent cannot serve in any mode"
  if healthy ~= nil and healthy.message ~= nil then
    hs.message = hs.message .. ": " .. healthy.message
  end
  return hs
end
if last ~= nil and spec.rolloutToken ~= nil and last.rolloutToken == spec.rolloutToken
  and (last.result == "RolledBack" or last.result == "Failed") then
  hs.status = "Degraded"
  hs.message = "Switch to " .. tostring(last.to) .. " " .. last.result
  if last.reason ~= nil then
    hs.message = hs.message .. ": " .. last.reason
  end
  return hs
end
if status.phase == nil or status.phase == "Initializing" then
  hs.message = "The agent is starting"
  return hs
end
if status.phase ~= "Active" then
  hs.message = "Switch in phase " .. status.phase
  return hs
end
if spec.desiredMode ~= nil and status.activeMode ~= spec.desiredMode then
  if spec.desiredMode == "external" then
    hs.message = "Waiting to hand over from " .. tostring(status.activeMode) .. " to another service proxy (external)"
  else
    hs.message = "Waiting to switch from " .. tostring(status.activeMode) .. " to " .. spec.desiredMode
  end
  return hs
end
if healthy ~= nil and healthy.status == "False" then
  hs.status = "Degraded"
  hs.message = healthy.message
  return hs
end
hs.status = "Healthy"
if status.activeMode == "external" then
  hs.message = "Handed to another service proxy (mode external); Switchyard's rules are removed"
  return hs
end
hs.message = "Serving in " .. tostring(status.activeMode) .. " mode"
return hs
