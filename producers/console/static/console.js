// calmq console: live updates and keyboard shortcuts. No framework, no build step; every
// page works without it (it only keeps pages fresh and saves keystrokes).
"use strict";

(function () {
  // The server renders every row and history entry (one template each); this script only
  // fetches them again and puts them in place.

  function say(message) {
    var status = document.getElementById("status");
    if (status) { status.textContent = message; }
  }

  function fetchText(url) {
    return fetch(url, { credentials: "same-origin" }).then(function (r) {
      return r.ok ? r.text().then(function (text) { return { text: text, headers: r.headers }; })
                  : null;
    });
  }

  // -- a job's page: follow the API's SSE (/v1/jobs/{id}/events) -------------------------
  // Each event asks the server for the history after the last entry shown: the entries as
  // the page renders them, and the job's status.
  function followJob(timeline) {
    var id = timeline.dataset.job;
    var badge = document.getElementById("job-status");
    var after = timeline.dataset.after;
    var seenKey = "calmq-seen-" + id;
    var seen = JSON.parse(sessionStorage.getItem(seenKey) || "[]");
    var pending = Promise.resolve();
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
    function catchUp() {
      // One request at a time, in order: each starts after the last entry shown.
      pending = pending.then(function () {
        return fetchText(timeline.dataset.live + "?after=" + encodeURIComponent(after));
      }).then(function (got) {
        if (!got) { return; }
        var holder = document.createElement("ol");
        holder.innerHTML = got.text;
        Array.prototype.slice.call(holder.children).forEach(function (li) {
          li.classList.add("new");
          timeline.appendChild(li);
        });
        after = got.headers.get("X-Calmq-Last-Event") || after;
        setStatus(got.headers.get("X-Calmq-Job-Status"));
      }).catch(function () { /* the next event tries again */ });
      return pending;
    }
    // A streamed step's text (output.delta events; reset: a new attempt starts over),
    // kept for the tab so it is still shown after the reload at the job's end.
    var output = document.getElementById("output");
    var outputKey = "calmq-output-" + id;
    function showOutput(text, deltas) {
      if (!output) { return; }
      output.textContent = text;
      output.dataset.deltas = String(deltas);
      document.getElementById("output-section").hidden = !text && !deltas;
      sessionStorage.setItem(outputKey, JSON.stringify({ text: text, deltas: deltas }));
    }
    var kept = JSON.parse(sessionStorage.getItem(outputKey) || "null");
    if (kept) { showOutput(kept.text, kept.deltas); }
    if (!seen.length) { seen.push(timeline.dataset.status); }
    showSeen();
    if (timeline.dataset.terminal === "1" || !window.EventSource) { return; }
    var source = new EventSource("/v1/jobs/" + id + "/events?after=" + after);
    source.addEventListener("output.delta", function (ev) {
      if (!output) { return; }
      var delta = JSON.parse(ev.data);
      var text = output.textContent;
      // A page opened mid-stream gets the text so far first; a delta already shown (the
      // stream reconnected) is not added twice.
      if (delta.offset === text.length) {
        showOutput(text + delta.text, Number(output.dataset.deltas) + 1);
      }
    });
    source.addEventListener("reset", function () { showOutput("", 0); });
    timeline.dataset.types.split(" ").forEach(function (type) {
      source.addEventListener(type, catchUp);
    });
    source.addEventListener("end", function (ev) {
      source.close();
      var status = JSON.parse(ev.data).status;
      catchUp().then(function () {
        setStatus(status);
        say("The job is " + status + "; reloading for its result.");
        // The artifact, the decision and the attempts are rendered by the server.
        window.setTimeout(function () { window.location.reload(); }, 400);
      });
    });
    source.onerror = function () {
      if (source.readyState === EventSource.CLOSED) { say("Live updates stopped; reload."); }
    };
  }

  // -- lists: their rows, rendered by the server again every two seconds ------------------
  // A table with data-live is replaced by what that URL answers (caption, head and rows);
  // the dead-letter groups also name the groups shown, so an emptied one stays at 0.
  function refresh(tableEl) {
    function url() {
      var keep = Array.prototype.map.call(tableEl.querySelectorAll("[data-group]"),
        function (el) { return "keep=" + encodeURIComponent(el.dataset.group); });
      if (!keep.length) { return tableEl.dataset.live; }
      return tableEl.dataset.live + (tableEl.dataset.live.indexOf("?") < 0 ? "?" : "&") +
        keep.join("&");
    }
    function tick() {
      fetchText(url()).then(function (got) {
        if (!got) { return; }
        tableEl.innerHTML = got.text;
        tableEl.dataset.refreshed = String(Number(tableEl.dataset.refreshed || 0) + 1);
      }).catch(function () { /* the next tick tries again */ });
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
    document.querySelectorAll("table[data-live]").forEach(refresh);
    var queue = document.getElementById("review-queue");
    if (queue) { listKeys(queue); }
    if (document.getElementById("approve-form")) { reviewKeys(); }
    pickAll();
  });
})();
