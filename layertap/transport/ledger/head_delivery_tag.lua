-- The delivery tag of the message next in line in KEYS[1] (false if the queue is empty, "" if it
-- has none): the only part of the message that leaves Redis. A tag is a property of the message
-- (kombu's JSON); the body is base64 and the headers' reprs escape quotes, so the first match is
-- the tag.
local message = redis.call('LINDEX', KEYS[1], -1)
if not message then return false end
return string.match(message, '"delivery_tag": *"([^"]*)"') or ''
