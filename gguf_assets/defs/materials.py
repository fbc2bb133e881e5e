"""Materials: teacher, student, prompt datasets, optional vision encoder, each pinned."""


import dagster as dg

from gguf_assets.defs.panels import panel_metadata
from gguf_assets.defs.resources import ProjectResource
from gguf_assets.lib.core import atomic
from gguf_assets.lib.core.markdown import markdown_table
from gguf_assets.lib.materials.pinning.resolve import resolve_materials
from gguf_assets.pipeline import groups
from gguf_assets.pipeline.settings_observation import settings_key


@dg.asset(group_name=groups.MATERIALS, deps=[settings_key("materials")],
          description="Teacher, student, prompt datasets and the optional vision "
          "encoder, each a local folder or hub repo pinned to the commit (or content hash) it resolved to.")
def materials(context: dg.AssetExecutionContext, project: ProjectResource) -> dg.MaterializeResult:
    token = project.hub.read_token()
    manifest = resolve_materials(project.paths(), project.settings(), token=token)
    metadata: dict = {"manifest": dg.MetadataValue.path(str(project.paths().materials_manifest))}
    entries = manifest.entries()
    rows = [[e["role"], f"`{e['source']}`", e.get("origin", "local"), f"`{e['commit']}`", e["files"],
             f"{e['bytes'] / 2**20:.1f}"] for e in entries]
    for e in entries:
        metadata[f"{e['role']}_commit"] = dg.MetadataValue.text(e["commit"])
    metadata["materials"] = dg.MetadataValue.md(markdown_table(
        ["role", "source", "from", "pinned to", "files", "MiB"], rows))
    metadata["total_mib"] = sum(e["bytes"] for e in entries) / 2**20
    downloads = manifest.downloads
    metadata["downloaded_mib"] = sum(d["downloaded_bytes"] for d in downloads) / 2**20
    metadata["download_seconds"] = sum(d["seconds"] for d in downloads)
    metadata["refetched_files"] = sum(d["refetched"] for d in downloads)
    metadata["hub_token_used"] = token is not None
    qr = manifest.query_rows if project.settings().materials.query_rows else None
    if qr:  # materials.query_rows: one tensor of another file, fetched by range
        metadata["query_rows"] = dg.MetadataValue.md(markdown_table(
            ["source", "file", "tensor", "pinned to", "shape", "dtype", "fetched bytes", "sha256"],
            [[f"`{qr['source']}`", f"`{qr.get('file') or ''}`", f"`{qr['tensor']}`", f"`{qr['commit']}`",
              f"{qr['shape']}", qr["dtype"], qr.get("fetched_bytes", 0), f"`{qr['tensor_sha256']}`"]]))
        metadata["query_rows_commit"] = dg.MetadataValue.text(qr["commit"])
    metadata.update(panel_metadata())
    metadata.update(project.stage_metadata("materials"))
    # Its data version is what it pinned: re-resolving to the same commits changes nothing downstream.
    pinned = [[e["role"], e["source"], e["commit"]] for e in entries]
    if qr:
        pinned.append(["query_rows", qr["source"], qr["commit"], qr["tensor"], qr["tensor_sha256"]])
    pins = atomic.fingerprint(pinned)
    project.result_written(context)
    return dg.MaterializeResult(data_version=dg.DataVersion(pins), metadata=metadata)
