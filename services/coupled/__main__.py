from common import logs, runner
from services.coupled import config
from services.coupled.service import serve

cfg = config.load()
logs.setup_logging(cfg.log_level, cfg.instance_id)
runner.run(lambda stop: serve(cfg, stop))
