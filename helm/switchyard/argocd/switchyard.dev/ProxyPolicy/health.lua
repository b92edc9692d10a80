-- Argo CD health of a Switchyard ProxyPolicy (switchyard.dev/v1alpha1).
-- Uses only Lua's base functions (Argo CD runs health scripts without the standard libraries).
--   Progressing: no status yet, a status for an older generation, waves under way or rolling back
--   Degraded:    Degraded=True (failure budget spent), or every selected node is governed by a
--                policy with higher precedence (Conflict=True and no node left)
--   Suspended:   paused (spec.rollout.paused, awaiting approval, outside the window, rolled back
--                on request)
--   Healthy:     Ready=True and every governed node is healthy or left alone as incompatible
local hs = { status = "Progressing", message = "Waiting for the Switchyard operator to report status" }

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

local function num(v)
  if v == nil then
    return 0
  end
  return v
end

if obj.status == nil then
  return hs
end
local status = obj.status
local generation = obj.metadata.generation
if generation ~= nil and status.observedGeneration ~= generation then
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
    .. " (status is for " .. tostring(status.observedGeneration) .. ")"
  return hs
end

local ready = condition(status.conditions, "Ready")
if ready ~= nil and generation ~= nil and ready.observedGeneration ~= nil and ready.observedGeneration ~= generation then
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end
local degraded = condition(status.conditions, "Degraded")
local paused = condition(status.conditions, "Paused")
local progressing = condition(status.conditions, "Progressing")
local conflict = condition(status.conditions, "Conflict")
local headline = ""
if ready ~= nil and ready.message ~= nil then
  headline = ready.message
end

if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = degraded.message
  return hs
end
if conflict ~= nil and conflict.status == "True" and num(status.targetNodes) == 0 then
  hs.status = "Degraded"
  hs.message = "No node is governed by this policy: " .. conflict.message
  return hs
end
if progressing ~= nil and progressing.status == "True" and progressing.reason == "RollingBack" then
  hs.status = "Progressing"
  hs.message = progressing.message
  return hs
end
local specPaused = obj.spec ~= nil and obj.spec.rollout ~= nil and obj.spec.rollout.paused == true
if (paused ~= nil and paused.status == "True") or specPaused then
  hs.status = "Suspended"
  if paused ~= nil and paused.status == "True" then
    hs.message = paused.reason .. ": " .. paused.message
  else
    hs.message = "spec.rollout.paused is true"
  end
  return hs
end
if ready ~= nil and ready.status == "True"
  and num(status.healthyNodes) + num(status.incompatibleNodes) == num(status.targetNodes) then
  hs.status = "Healthy"
  hs.message = headline
  if conflict ~= nil and conflict.status == "True" then
    hs.message = headline .. "; " .. conflict.message
  end
  return hs
end
if status.phase == "Pending" and num(status.targetNodes) == 0 then
  hs.status = "Healthy"
  hs.message = headline
  return hs
end
if headline ~= "" then
  hs.message = headline
end
return hs
