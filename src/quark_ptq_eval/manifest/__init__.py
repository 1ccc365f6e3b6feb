"""Phase 1, step 3 — manifest: ``run_manifest.yaml`` with the exact command to approve."""

from .build import ENGINES, build_manifest, staging_dir

__all__ = ["ENGINES", "build_manifest", "staging_dir"]
