package infer

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// Print writes the plan: the model, each GPU's share and its bytes by
// term at a forward of budget tokens (0: the plan's own budget), the
// largest forward each GPU holds, and the budget to run with (or which
// GPU is short and by how much). teacherd --plan and cachectl plan print
// it.
func (p TeacherPlan) Print(w io.Writer, budget int) {
	o, cfg := p.Opts, p.cfg
	gib := func(b int64) string {
		if b == 0 {
			return "-"
		}
		return fmt.Sprintf("%.2f GiB", float64(b)/(1<<30))
	}
	layers := fmt.Sprintf("%d layers", cfg.Layers)
	if cfg.Layers == 1 {
		layers = "1 layer"
	}
	fmt.Fprintf(w, "teacher plan: %s, %.2fB parameters (%s, hidden %d, vocab %d), %s weights, top-k up to %d, samples up to %d tokens",
		cfg.Arch, float64(cfg.Params())/1e9, layers, cfg.Hidden, cfg.VocabSize, o.Weights, o.K, o.MaxLen)
	if o.Draws > 0 {
		fmt.Fprintf(w, ", up to %d draws a position", o.Draws)
	}
	fmt.Fprintln(w)
	ords := make([]string, len(o.Devices))
	for i, d := range o.Devices {
		ords[i] = fmt.Sprint(d)
	}
	n, at := budget, "the token budget asked for"
	if n <= 0 {
		n, at = max(p.Budget, 1), "the largest token budget every GPU holds"
		if p.Budget == 0 {
			at = "one token: not even that fits"
		}
	}
	fmt.Fprintf(w, "%d GPU(s) of %s (ordinals %s), %s of each kept in reserve; bytes at a forward of %d tokens (%s)\n",
		o.GPUs, gib(o.DeviceBytes), strings.Join(ords, ","), gib(p.Reserve), n, at)
	if o.Weights == WeightsFP8 {
		fmt.Fprintln(w, "fp8: the layers' Linear weights in E4M3 (1 byte a weight) with a fp32 scale per output channel; the embedding, norms, MoE routers and LM head stay BF16 (teacherd --weights fp8, cachectl fill --teacher-weights fp8)")
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "GPU\tholds\tweights\tactivations\thand-off\tdraws\tLM head scratch\tworkspace\ttotal\tleft\tlargest forward (tokens)")
	var copies []string
	for i, st := range p.Stages {
		b := p.StageBytes(i, n)
		total := st.WeightBytes + b.Total()
		left := o.DeviceBytes - p.Reserve - total
		largest := fmt.Sprint(st.Budget)
		if st.Budget == 0 {
			largest = "none"
		}
		leftS := gib(left)
		if left < 0 {
			leftS = "short " + gib(-left)
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", st.Device, st.What(), gib(st.WeightBytes), gib(b.Activations),
			gib(b.Handoff), gib(b.Draws), gib(b.LMHead), gib(b.Workspace), gib(total), leftS, largest)
		if st.CopyBytes > 0 {
			c := fmt.Sprintf("%.1f MiB", float64(st.CopyBytes)/(1<<20))
			if st.CopyBytes < 1<<20 {
				c = fmt.Sprintf("%.1f KiB", float64(st.CopyBytes)/(1<<10))
			}
			copies = append(copies, fmt.Sprintf("GPU %d %s", st.Device, c))
		}
	}
	tw.Flush()
	fmt.Fprintln(w)
	fmt.Fprintln(w, "total = weights + activations + hand-off + draws + the larger of the LM head's scratch and the layers' workspace (a forward never holds both)")
	if len(copies) > 0 {
		fmt.Fprintf(w, "weights include copies of tensors another GPU holds too (the next GPU's first input norm; a tied LM head's embedding): %s\n", strings.Join(copies, ", "))
	}
	if err := p.Check(n); err != nil {
		fmt.Fprintf(w, "does not fit: %v\n", err)
		return
	}
	if p.Budget > 0 {
		fmt.Fprintf(w, "token budget: up to %d (teacherd --token-budget, cachectl fill --token-budget): the largest forward every GPU holds\n", p.Budget)
	}
}
