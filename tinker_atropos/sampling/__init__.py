"""Where tokens are sampled: one continuous-batching engine per served model (``engine.py``), shared by every
sampling client and session of the Tinker API and by the Atropos loop's inference endpoint; what one request asks
of it and how its tokens are drawn (``params.py``), and which request runs next (``scheduler.py``)."""
