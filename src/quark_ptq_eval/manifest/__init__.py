"""Phase 1, step 3 — manifest: ``run_manifest.yaml`` with the exact command to approve."""

from quark_ptq_eval.manifest.build import build_manifest, staging_dir

__all__ = ["build_manifest", "staging_dir"]
