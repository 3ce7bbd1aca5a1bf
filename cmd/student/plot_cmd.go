package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"distill/internal/cli"
	"distill/internal/runplot"
)

func init() {
	commands.Register(&cli.Command{Name: "plot", Summary: "draw the train and eval curves of runs (metrics.jsonl) into a PNG, SVG or PDF: loss, KD, CE, LR, grad norm, accuracy", Run: runPlot})
}

// plotLog is where student plot warns (a test's buffer in tests).
var plotLog io.Writer = os.Stderr

// listFlag is a repeatable string flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(s string) error { *l = append(*l, s); return nil }

func runPlot(args []string) error {
	fs := flag.NewFlagSet("student plot", flag.ContinueOnError)
	var runs, hlines listFlag
	fs.Var(&runs, "run", "a run directory of student train, `[LABEL=]DIR` (repeatable: runs are overlaid; the label defaults to the directory's name)")
	fs.Var(&hlines, "hline", "a horizontal reference line, `[PANEL:]LABEL=VALUE`, e.g. 'teacher CE=1.23' (panel ce unless named: "+strings.Join(runplot.PanelNames(), ", ")+"; repeatable)")
	out := fs.String("out", "", "output image, `FILE.png` (or .svg, .pdf); replaced atomically (required)")
	title := fs.String("title", "", "title above the panels")
	width := fs.Int("width", 1500, "image width in pixels")
	height := fs.Int("height", 900, "image height in pixels")
	cols := fs.Int("cols", 3, "panels per row")
	panelList := fs.String("panels", "", "panels to draw, in this order, `NAME[,NAME...]` (default: all of "+strings.Join(runplot.PanelNames(), ", ")+")")
	from := fs.Int("from", 0, "leave out the steps before `STEP` (the first steps' large losses flatten the rest)")
	if err := cli.ParseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return cli.Usagef("unexpected arguments %v (flags go before them?)", fs.Args())
	}
	if len(runs) == 0 {
		return cli.Usagef("--run DIR is required (a `student train` run directory; repeat it to overlay runs)")
	}
	if *out == "" {
		return cli.Usagef("--out FILE.png is required")
	}
	if *cols < 1 {
		return cli.Usagef("--cols %d: want at least 1", *cols)
	}
	if *width < 1 || *height < 1 {
		// 0 drew the default size without a word.
		return cli.Usagef("--width %d --height %d: want 200..20000 x 150..20000 pixels", *width, *height)
	}
	if *from < 0 {
		return cli.Usagef("--from %d: want a step >= 0", *from)
	}
	// What the command line alone gets wrong is a usage error (exit 2),
	// found before any run is read: a bad --hline, --panels, --out name
	// or size exited 1, as a run that could not be read does.
	var hs []runplot.HLine
	for _, s := range hlines {
		h, err := runplot.ParseHLine(s)
		if err != nil {
			return cli.Usage(err)
		}
		hs = append(hs, h)
	}
	sel := runplot.Select{From: *from}
	if *panelList != "" {
		sel.Panels = strings.Split(*panelList, ",")
	}
	opts := runplot.Options{Width: *width, Height: *height, Title: *title, Cols: *cols, Select: sel}
	if err := runplot.Check(*out, hs, opts); err != nil {
		return cli.Usage(err)
	}
	var rs []*runplot.Run
	for _, a := range runs {
		label, dir := "", a
		// LABEL=DIR, unless the whole argument is an existing path.
		if l, d, ok := strings.Cut(a, "="); ok {
			if _, err := os.Stat(a); err != nil {
				label, dir = l, d
			}
		}
		r, err := runplot.Load(dir, label)
		if err != nil {
			return err
		}
		warnSkipped(plotLog, r)
		rs = append(rs, r)
	}
	ps, err := runplot.Write(*out, rs, hs, opts)
	if err != nil {
		return err
	}
	names := make([]string, len(ps))
	for i, p := range ps {
		names[i] = p.Name
	}
	noun := "runs"
	if len(rs) == 1 {
		noun = "run"
	}
	fmt.Fprintf(stdout, "wrote %s: %d %s, panels %s\n", *out, len(rs), noun, strings.Join(names, ", "))
	return nil
}

// warnSkipped says, in one line, which lines of r's metrics.jsonl were
// not JSON and were left out of the plot (runplot.Load), so that a
// curve with a gap in it has its reason next to it.
func warnSkipped(w io.Writer, r *runplot.Run) {
	n := len(r.Skipped)
	if n == 0 {
		return
	}
	const why = "(a write cut short by a crash?): skipped; the rest of the run is plotted"
	if n == 1 {
		fmt.Fprintf(w, "student plot: warning: %s:%d: not JSON %s\n", r.Path, r.Skipped[0], why)
		return
	}
	more := make([]string, 0, 10)
	for _, l := range r.Skipped[1:min(n, 11)] {
		more = append(more, strconv.Itoa(l))
	}
	if n > 11 {
		more = append(more, "...")
	}
	fmt.Fprintf(w, "student plot: warning: %s:%d: this line and %d more (lines %s) are not JSON %s\n", r.Path, r.Skipped[0], n-1, strings.Join(more, ", "), why)
}
