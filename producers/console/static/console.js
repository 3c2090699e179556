// calmq console: live updates and keyboard shortcuts. No framework, no build step; every
// page works without it (it only keeps pages fresh and saves keystrokes).
"use strict";

(function () {
  // Which job status an event moves the job to (calmq.jobs.EventType -> Status).
  var STATUS_OF = {
    queued: "queued", running: "running", retry_scheduled: "retrying",
    requeued_after_restart: "queued", requeued_by_sweeper: "queued",
    review_requested: "awaiting_review", reviewed: null, completed: "completed",
    dead_lettered: "dead_letter", cancelled: "cancelled", redriven: "queued"
  };

  function text(tag, value, cls) {
    var el = document.createElement(tag);
    el.textContent = value == null ? "" : String(value);
    if (cls) { el.className = cls; }
    return el;
  }

  function say(message) {
    var status = document.getElementById("status");
    if (status) { status.textContent = message; }
  }

  // -- a job's page: follow the API's SSE (/v1/jobs/{id}/events) -------------------------
  function followJob(timeline) {
    var id = timeline.dataset.job;
    var badge = document.getElementById("job-status");
    var seenKey = "calmq-seen-" + id;
    var seen = JSON.parse(sessionStorage.getItem(seenKey) || "[]");
    function showSeen() {
      var el = document.getElementById("seen");
      if (el && seen.length) { el.textContent = "seen live: " + seen.join(" \u2192 "); }
      if (badge) { badge.dataset.seen = seen.join(" "); }
    }
    function setStatus(status) {
      if (!status || !badge) { return; }
      badge.textContent = status;
      badge.className = "badge " + status;
      if (seen[seen.length - 1] !== status) { seen.push(status); }
      sessionStorage.setItem(seenKey, JSON.stringify(seen));
      showSeen();
    }
    if (!seen.length) { seen.push(timeline.dataset.status); }
    showSeen();
    if (timeline.dataset.terminal === "1" || !window.EventSource) { return; }
    var source = new EventSource("/v1/jobs/" + id + "/events?after=" + timeline.dataset.after);
    function onEvent(ev) {
      var data = JSON.parse(ev.data);
      var li = document.createElement("li");
      li.className = "new";
      li.dataset.type = data.type;
      li.appendChild(text("span", data.type, "etype"));
      li.appendChild(document.createTextNode(" " + data.at + " "));
      li.appendChild(text("span", "attempt " + data.attempt, "muted"));
      li.appendChild(document.createTextNode(" " + JSON.stringify(data.detail || {})));
      timeline.appendChild(li);
      if (STATUS_OF[data.type]) { setStatus(STATUS_OF[data.type]); }
    }
    timeline.dataset.types.split(" ").forEach(function (type) {
      source.addEventListener(type, onEvent);
    });
    source.addEventListener("end", function (ev) {
      source.close();
      setStatus(JSON.parse(ev.data).status);
      say("The job is " + JSON.parse(ev.data).status + "; reloading for its result.");
      // The artifact, the decision and the attempts are rendered by the server.
      window.setTimeout(function () { window.location.reload(); }, 400);
    });
    source.onerror = function () {
      if (source.readyState === EventSource.CLOSED) { say("Live updates stopped; reload."); }
    };
  }

  // -- lists: refresh from their JSON every two seconds -----------------------------------
  function refreshJobs(tableEl) {
    var platform = tableEl.dataset.platform === "1";
    function row(job) {
      var tr = document.createElement("tr");
      var a = text("a", job.job_id.slice(0, 8));
      a.href = "/console/jobs/" + job.job_id;
      var first = document.createElement("td");
      first.appendChild(a);
      tr.appendChild(first);
      var cells = [job.workflow];
      if (platform) { cells.unshift(job.tenant); }
      cells.forEach(function (v) { tr.appendChild(text("td", v)); });
      var st = document.createElement("td");
      st.appendChild(text("span", job.status, "badge " + job.status));
      tr.appendChild(st);
      [job.lane, job.pool, job.step, job.attempt, job.created_at].forEach(function (v) {
        tr.appendChild(text("td", v));
      });
      return tr;
    }
    function tick() {
      fetch(tableEl.dataset.live, { credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (body) {
          if (!body) { return; }
          var tbody = tableEl.querySelector("tbody");
          var fresh = document.createElement("tbody");
          body.jobs.forEach(function (job) { fresh.appendChild(row(job)); });
          if (!body.jobs.length) {
            var tr = document.createElement("tr");
            var td = text("td", "no jobs match", "empty");
            td.colSpan = tableEl.querySelectorAll("th").length;
            tr.appendChild(td);
            fresh.appendChild(tr);
          }
          tableEl.replaceChild(fresh, tbody);
          tableEl.querySelector("caption").textContent =
            body.jobs.length + " job(s), newest first (live)";
        })
        .catch(function () { /* the next tick tries again */ });
    }
    window.setInterval(tick, 2000);
  }

  function refreshDeadLetters(tableEl) {
    function tick() {
      fetch(tableEl.dataset.live, { credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (body) {
          if (!body) { return; }
          var counts = {};
          body.groups.forEach(function (g) {
            counts[[g.workflow, g.step, g.failure_class, g.code].join("|")] = g.count;
          });
          tableEl.querySelectorAll(".count").forEach(function (el) {
            var n = counts[el.dataset.group] || 0;
            if (String(n) !== el.textContent) { el.textContent = String(n); }
          });
        })
        .catch(function () { /* the next tick tries again */ });
    }
    window.setInterval(tick, 2000);
  }

  // -- keyboard: j/k through a list, Enter opens; a approves, r goes to the reason ---------
  function typing(ev) {
    var t = ev.target;
    return t && (t.tagName === "INPUT" || t.tagName === "TEXTAREA" || t.tagName === "SELECT" ||
                 t.isContentEditable);
  }

  function listKeys(tableEl) {
    var at = -1;
    document.addEventListener("keydown", function (ev) {
      if (typing(ev) || ev.ctrlKey || ev.metaKey || ev.altKey) { return; }
      var rows = tableEl.querySelectorAll("tbody tr");
      if (!rows.length) { return; }
      if (ev.key === "j" || ev.key === "k") {
        if (at >= 0 && rows[at]) { rows[at].classList.remove("focus"); }
        at = Math.max(0, Math.min(rows.length - 1, at + (ev.key === "j" ? 1 : -1)));
        rows[at].classList.add("focus");
        var link = rows[at].querySelector("a");
        if (link) { link.focus(); }
        ev.preventDefault();
      }
    });
  }

  function reviewKeys() {
    document.addEventListener("keydown", function (ev) {
      if (typing(ev) || ev.ctrlKey || ev.metaKey || ev.altKey) { return; }
      if (ev.key === "a") {
        ev.preventDefault();
        document.getElementById("approve-form").requestSubmit();
      } else if (ev.key === "r") {
        ev.preventDefault();
        document.getElementById("reason").focus();
      }
    });
  }

  function pickAll() {
    var all = document.getElementById("pick-all");
    if (!all) { return; }
    all.addEventListener("change", function () {
      document.querySelectorAll("input.pick").forEach(function (box) { box.checked = all.checked; });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    var timeline = document.getElementById("timeline");
    if (timeline) { followJob(timeline); }
    var jobs = document.getElementById("jobs");
    if (jobs) { refreshJobs(jobs); }
    var groups = document.getElementById("dead-groups");
    if (groups) { refreshDeadLetters(groups); }
    var queue = document.getElementById("review-queue");
    if (queue) { listKeys(queue); }
    if (document.getElementById("approve-form")) { reviewKeys(); }
    pickAll();
  });
})();
