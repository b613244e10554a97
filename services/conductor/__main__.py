from common import logs, runner
from services.conductor import config
from services.conductor.service import serve

cfg = config.load()
logs.setup_logging(cfg.log_level, cfg.instance_id)
runner.run(lambda stop: serve(cfg, stop))
