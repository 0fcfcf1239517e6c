// The site's diagrams: each ```mermaid block (a <pre class="diagram">, scripts/mkdocs_reference.py) drawn as SVG in
// the page by the copy of mermaid.js the site serves itself (assets/javascripts/mermaid.min.js): nothing is read
// from the network. The script is loaded only by a page that has a diagram, and the diagrams are drawn again in
// the other colour scheme when the reader toggles it.
(function () {
  "use strict";
  var script = document.currentScript;
  var mermaidUrl = new URL("../assets/javascripts/mermaid.min.js", script.src).href;
  var loading = null;
  var drawn = 0;
  var sources = new WeakMap();  // a drawn diagram's source, to draw it again in the other colour scheme

  function loadMermaid() {
    if (window.mermaid) return Promise.resolve(window.mermaid);
    if (!loading) {
      loading = new Promise(function (resolve, reject) {
        var tag = document.createElement("script");
        tag.src = mermaidUrl;
        tag.onload = function () { resolve(window.mermaid); };
        tag.onerror = function () { reject(new Error("could not load " + mermaidUrl)); };
        document.head.appendChild(tag);
      });
    }
    return loading;
  }

  function dark() {
    return document.body.getAttribute("data-md-color-scheme") === "slate";
  }

  function draw(blocks) {
    if (!blocks.length) return Promise.resolve();
    return loadMermaid().then(function (mermaid) {
      mermaid.initialize({ startOnLoad: false, securityLevel: "strict", theme: dark() ? "dark" : "default" });
      var chain = Promise.resolve();
      blocks.forEach(function (block) {
        chain = chain.then(function () {
          var source = sources.get(block) || block.textContent;
          return mermaid.render("diagram-" + drawn++, source).then(function (result) {
            var figure = document.createElement("div");
            figure.className = "diagram";
            sources.set(figure, source);
            figure.innerHTML = result.svg;
            block.replaceWith(figure);
          }).catch(function (error) {
            block.classList.add("diagram-failed");
            console.error("diagram not drawn:", error);
          });
        });
      });
      return chain;
    });
  }

  function drawPage() {
    draw(Array.prototype.slice.call(document.querySelectorAll("pre.diagram")));
  }

  var scheme = dark();
  new MutationObserver(function () {
    if (dark() === scheme) return;
    scheme = dark();
    draw(Array.prototype.slice.call(document.querySelectorAll("div.diagram")));
  }).observe(document.body, { attributes: true, attributeFilter: ["data-md-color-scheme"] });

  if (window.document$ && typeof window.document$.subscribe === "function") {
    window.document$.subscribe(drawPage);
  } else if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", drawPage);
  } else {
    drawPage();
  }
})();
