package trainer

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"
)

// progress shows a one-line bar on a terminal, or a log line every
// log.every steps otherwise (files and CI logs do not want \r).
type progress struct {
	w      io.Writer
	tty    bool
	every  int
	total  int
	start  time.Time
	shown  bool
	first  int
	tokens float64
	// sft: an SFT-only run (data.dataset, no teacher): no KD to show.
	sft bool
}

func newProgress(w io.Writer, mode string, every, total int) *progress {
	tty := false
	under := w
	if lw, ok := w.(*lockedWriter); ok { // Run's serialized log
		under = lw.w
	}
	if f, ok := under.(*os.File); ok {
		if fi, err := f.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
			tty = true
		}
	}
	switch mode {
	case "on":
		tty = true
	case "off":
		tty = false
	}
	return &progress{w: w, tty: tty, every: every, total: total, start: time.Now(), first: -1}
}

func (p *progress) step(sm StepMetrics) {
	if p.first < 0 {
		p.first = sm.Step - 1
	}
	p.tokens += float64(sm.Tokens)
	el := time.Since(p.start)
	done := sm.Step - p.first
	eta := time.Duration(float64(el) / float64(done) * float64(p.total-sm.Step)).Round(time.Second)
	tps := p.tokens / el.Seconds()
	if p.tty {
		const width = 30
		n := width * sm.Step / max(p.total, 1)
		bar := strings.Repeat("=", n) + strings.Repeat(" ", width-n)
		fmt.Fprintf(p.w, "\r\x1b[K%d/%d [%s] loss %.4f lr %.2e |g| %.3f %.0f tok/s %.1f GFLOP/s eta %s", sm.Step, p.total, bar, sm.Loss, sm.LR, sm.GradNorm, tps, sm.GFLOPs, eta)
		p.shown = true
		return
	}
	if sm.Step%p.every != 0 && sm.Step != p.total {
		return
	}
	if p.sft {
		fmt.Fprintf(p.w, "step %d/%d loss %.4f ce %.4f lr %.3e grad_norm %.4f %.0f tok/s %.2f GFLOP/s peak %.0f MiB eta %s\n",
			sm.Step, p.total, sm.Loss, sm.CE, sm.LR, sm.GradNorm, tps, sm.GFLOPs, float64(sm.PeakMemBytes)/(1<<20), eta)
	} else {
		fmt.Fprintf(p.w, "step %d/%d loss %.4f kd %.4f ce %.4f%s lr %.3e grad_norm %.4f %.0f tok/s %.2f GFLOP/s peak %.0f MiB eta %s\n",
			sm.Step, p.total, sm.Loss, sm.KD, sm.CE, teachersLine(sm.Teachers), sm.LR, sm.GradNorm, tps, sm.GFLOPs, float64(sm.PeakMemBytes)/(1<<20), eta)
	}
}

// clear ends the bar's line before other output.
func (p *progress) clear() {
	if p.shown {
		fmt.Fprintln(p.w)
		p.shown = false
	}
}
