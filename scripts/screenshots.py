"""Screenshots of what a user sees after `make demo`, taken in a real browser (headless Chromium
driven by Selenium, both from Debian's packages), into docs/ui/.

    make screenshots        # the stack must be up and hold a finished demo run (`make demo`)

The pages are single-page apps: each shot waits until the page shows a text it must contain
(a run name, a chart title), not a fixed time, and fails naming what it waited for.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.common.by import By

VIEW = "workflowType=machine_learning"  # MLflow's Model-training view (see rlhf.tracking)


def _basic(user: str) -> str:
    return "Basic " + base64.b64encode(user.encode()).decode()


def api(url: str, body: dict | None = None) -> dict:
    """A JSON call to the stack's MLflow or Prefect API, with its credentials (`scripts/stack.sh env`)."""
    data = None if body is None else json.dumps(body).encode()
    user = (os.environ["PREFECT_API_AUTH_STRING"] if url.startswith(os.environ["PREFECT_API_URL"])
            else f"{os.environ['MLFLOW_TRACKING_USERNAME']}:{os.environ['MLFLOW_TRACKING_PASSWORD']}")
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                              "Authorization": _basic(user)},
                                     method="POST" if body is not None else "GET")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def browser(width: int, height: int) -> webdriver.Chrome:
    options = Options()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}"):
        options.add_argument(argument)
    return webdriver.Chrome(options=options)


def shoot(driver: webdriver.Chrome, url: str, must_show: list[str], file: Path, settle_s: float = 3.0,
          timeout_s: float = 60.0, then=None) -> None:
    """Load `url`, wait until the page shows every text in `must_show`, do `then(driver)` (a
    click, a field filled), and save the window as `file`."""
    driver.get("about:blank")  # a new hash route alone would not reload the app
    # The stack's servers want its credentials (scripts/stack.sh): sent with every request the page makes.
    user = (os.environ["PREFECT_API_AUTH_STRING"] if url.startswith(os.environ["PREFECT_UI_URL"])
            else f"{os.environ['MLFLOW_TRACKING_USERNAME']}:{os.environ['MLFLOW_TRACKING_PASSWORD']}")
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": _basic(user)}})
    driver.get(url)
    deadline = time.monotonic() + timeout_s
    while True:
        text = driver.find_element(By.TAG_NAME, "body").text
        missing = [wanted for wanted in must_show if wanted not in text]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"{url}: the page never showed {missing} within {timeout_s:g} s")
        time.sleep(0.5)
    time.sleep(settle_s)  # charts draw after their titles appear
    if then is not None:
        then(driver)
        time.sleep(1)
    driver.save_screenshot(str(file))
    print(f"{file}: {url}")


def close_mlflow_assistant(driver: webdriver.Chrome) -> None:
    """MLflow 3.17 opens its chat assistant beside every page on first load; it hides half the page."""
    for button in driver.find_elements(By.CSS_SELECTOR, "button[aria-label='Close']"):
        driver.execute_script("arguments[0].click()", button)


def fill_ppo_learning_rate(driver: webdriver.Chrome) -> None:
    """The run form's PPO section: choose the number type of `Learning Rate` and type 0.0001 (not submitted)."""
    def field():
        label = driver.find_elements(By.XPATH, "//*[normalize-space(text())='Learning Rate (Optional)']")[-1]
        return label.find_element(By.XPATH, "./ancestor::div[contains(@class,'schema-form-property-any-of-input')][1]")

    number = next(b for b in field().find_elements(By.TAG_NAME, "button") if b.text.strip() == "float")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", number)
    number.click()
    time.sleep(1)
    field().find_element(By.TAG_NAME, "input").send_keys("0.0001")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/ui")
    parser.add_argument("--experiment", default="rlhf")
    args = parser.parse_args()
    mlflow_ui = os.environ["MLFLOW_TRACKING_URI"].rstrip("/")
    prefect_ui, prefect_api = os.environ["PREFECT_UI_URL"].rstrip("/"), os.environ["PREFECT_API_URL"].rstrip("/")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    experiment = api(f"{mlflow_ui}/api/2.0/mlflow/experiments/get-by-name?experiment_name={args.experiment}")
    experiment_id = experiment["experiment"]["experiment_id"]
    runs = api(f"{mlflow_ui}/api/2.0/mlflow/runs/search", {
        "experiment_ids": [experiment_id], "filter": "tags.`rlhf.stage` = 'ppo' and attributes.status = 'FINISHED'",
        "order_by": ["attributes.start_time DESC"], "max_results": 1})["runs"]
    if not runs:
        print("no finished PPO run: run `make demo` first", file=sys.stderr)
        return 1
    ppo = runs[0]
    ppo_id, ppo_name = ppo["info"]["run_id"], ppo["info"]["run_name"]
    tags = {t["key"]: t["value"] for t in ppo["data"]["tags"]}
    pipeline = api(f"{mlflow_ui}/api/2.0/mlflow/runs/get?run_id={tags['rlhf.pipeline_run_id']}")["run"]
    pipeline_name = pipeline["info"]["run_name"]
    deployment = api(f"{prefect_api}/deployments/name/rlhf/ppo")
    flow_run_id = tags["rlhf.prefect_flow_run_id"]

    driver = browser(1600, 1000)
    try:
        shoot(driver, f"{mlflow_ui}/#/experiments/{experiment_id}/runs?{VIEW}", [pipeline_name],
              out / "mlflow-runs.png", then=close_mlflow_assistant)
        shoot(driver, f"{mlflow_ui}/#/experiments/{experiment_id}/runs/{ppo_id}/model-metrics?{VIEW}",
              [ppo_name, "gold_win_rate"], out / "mlflow-ppo-curves.png", settle_s=5.0, then=close_mlflow_assistant)
        shoot(driver, f"{mlflow_ui}/#/experiments/{experiment_id}/runs/{pipeline['info']['run_id']}?{VIEW}",
              [pipeline_name, "Description"], out / "mlflow-pipeline-run.png",
              then=lambda d: (close_mlflow_assistant(d), d.execute_script(
                  "arguments[0].scrollIntoView({block: 'start'})",
                  d.find_element(By.XPATH, "//*[normalize-space(text())='Description']"))))
        shoot(driver, f"{mlflow_ui}/#/models/rlhf-policy?{VIEW}", ["rlhf-policy", "champion"],
              out / "mlflow-registry.png", then=close_mlflow_assistant)
        shoot(driver, f"{prefect_ui}/runs/flow-run/{flow_run_id}", ["Completed", "ppo"], out / "prefect-flow-run.png")
        shoot(driver, f"{prefect_ui}/deployments/deployment/{deployment['id']}/run", ["Learning Rate", "overrides"],
              out / "prefect-run-form.png", then=fill_ppo_learning_rate)
    finally:
        driver.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
