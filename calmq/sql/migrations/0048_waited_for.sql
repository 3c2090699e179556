-- What a job's last `waiting` event was for: its reason, step and attempt ('<reason> <step>
-- <attempt>'). A hold writes its event only when this differs, so a job that goes from a
-- hold to a release pass and back to the same hold without running (a release clears
-- waiting_reason, not this; a hand-back takes the attempt back to the same number) is not
-- given a waiting event per pass, while a wait at a later step or attempt is told again.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS waited_for text;
