package examples

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestDocFlags: every --flag that README.md, docs/*.md and the examples
// give a student, cachectl or teacherd command (in a `code span` or a
// line of its own) is a flag of that command, as its -h lists them: a
// flag renamed or removed in the code fails here. `cachectl
// status|verify|...` takes the flags of any of the commands named.
func TestDocFlags(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binaries")
	}
	bin := t.TempDir()
	if out, err := exec.Command("go", "build", "-o", bin+"/", "distill/cmd/student", "distill/cmd/cachectl", "distill/cmd/teacherd").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	flagRE := regexp.MustCompile(`(?m)^  -([a-z0-9-]+)`)
	flags := map[string]map[string]bool{} // "student train", "teacherd"
	help := func(prog string, args ...string) {
		out, _ := exec.Command(filepath.Join(bin, prog), append(args, "-h")...).CombinedOutput()
		set := map[string]bool{"h": true, "help": true}
		for _, m := range flagRE.FindAllStringSubmatch(string(out), -1) {
			set[m[1]] = true
		}
		if len(set) < 3 {
			t.Fatalf("%s %v -h: no flags\n%s", prog, args, out)
		}
		flags[strings.Join(append([]string{prog}, args...), " ")] = set
	}
	for _, s := range strings.Fields("init train eval export plan plot") {
		help("student", s)
	}
	for _, s := range strings.Fields("fill tokenize plan score status verify inspect export gc repair reset") {
		help("cachectl", s)
	}
	help("teacherd")

	names, texts := readDocs(t)
	examples, _ := filepath.Glob("*.yaml")
	for _, e := range examples {
		b, err := os.ReadFile(e)
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, "examples/"+e)
		texts["examples/"+e] = string(b)
	}
	spanRE := regexp.MustCompile("`([^`\n]*)`")
	cmdRE := regexp.MustCompile(`^(?:#\s*)?(?:bin/)?(student|cachectl|teacherd)\b\s*([a-z|]*)`)
	optRE := regexp.MustCompile(`(?:^|[\s\[(])--([a-z][a-z0-9-]*)`)
	checked := 0
	for _, name := range names {
		var spans []string
		for _, m := range spanRE.FindAllStringSubmatch(texts[name], -1) {
			spans = append(spans, m[1])
		}
		spans = append(spans, strings.Split(texts[name], "\n")...)
		for _, sp := range spans {
			sp = strings.TrimSpace(strings.ReplaceAll(sp, `\|`, "|"))
			m := cmdRE.FindStringSubmatch(sp)
			if m == nil {
				continue
			}
			allowed := map[string]bool{}
			if m[1] == "teacherd" {
				allowed = flags["teacherd"]
			} else {
				for _, sub := range strings.Split(m[2], "|") {
					for f := range flags[m[1]+" "+sub] {
						allowed[f] = true
					}
				}
			}
			if len(allowed) == 0 {
				continue // not a command line: "student model", "cachectl COMMAND"
			}
			for _, o := range optRE.FindAllStringSubmatch(sp, -1) {
				checked++
				if !allowed[o[1]] {
					t.Errorf("%s: --%s is not a flag of %s %s (its -h): %q", name, o[1], m[1], m[2], sp)
				}
			}
		}
	}
	if checked < 100 {
		t.Errorf("checked %d flags: the docs' commands went missing?", checked)
	}
	t.Logf("%d flags checked", checked)
}
