"""The trajectory viewer: what ``/ui`` shows, and the admin read API behind it.

``service.Viewer`` answers the read API (sessions listed and filtered, a session's whole
response tree, a trajectory's tokens with their pieces, weights, logprobs, versions,
routed experts and grades) without HTTP; ``grades.GradeBook`` follows the trainer feed for
rewards and advantages; ``pieces.PieceCache`` turns token ids into text pieces. The page
itself is ``static/`` (HTML, one stylesheet, one script: no build step, no CDN), served by
``proxy/handlers/ui.py``.
"""
