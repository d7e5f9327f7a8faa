"""Deploy suite: typed config, hosts over SSH, preflight, weight sync and runtime plugins, image build/ship,
download, and the operate commands (status/logs/stop/restart). tasks.py calls into `twinspark.deploy.api`."""

from twinspark.deploy.errors import DeployError

__all__ = ["DeployError"]
