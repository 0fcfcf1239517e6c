"""Where tokens are sampled: one continuous-batching engine per served model, shared by every sampling client and
session of the Tinker API and by the Atropos loop's inference endpoint. ``engine.py`` moves requests between its
parts: the callers' handoff (``inbox.py``), one request's state (``request_state.py``), prompts read in chunks
(``prefill.py``), the running batch with its key/value cache and decode step (``running_batch.py``), and which
request runs next or gives up its room (``scheduler.py``); what a request asks and how its tokens are drawn is
``params.py``."""
