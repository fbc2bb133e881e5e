"""Materials: every source a project names, fetched, checked and pinned. By job:

* ``materials_run.py``: the record, ``materials/manifest.json``: read and written, its settings, fingerprint and
  whether it is current (no torch: `status` and the later stages read it).
* ``pinning/``: resolution and pinning, the materials step that writes that record.
* ``hub/``: the hub client (pinned, verified, resumable downloads in a watched child process);
  ``hub_shapes.py``: a hub model's config, index and headers without its weights, for `estimate`.
* ``teacher/``: the teacher's kind and files, its checks before the weights, its text stack.
* ``student/``: the student contract (would ggk run it as transformers does?) and a GGUF student converted.
* ``ggk_tokenizer.py`` (and its table ``ggk_letters.py``): the student's tokenizer as ggk rebuilds it.
* ``query_rows.py``: the query rows, one tensor fetched by range and stored alone.
"""
