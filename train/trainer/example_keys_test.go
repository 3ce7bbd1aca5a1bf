package trainer

import (
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"
)

// exampleKey is a key an example config documents, set or commented
// out, by its dotted path (a list's entries are their element type's
// keys: data.caches.dir).
type exampleKey struct {
	path string
	line int
}

// exampleKeys returns the keys of a YAML example, those set and those
// commented out ("  # key: value", the "# " removed gives the key's
// indentation), by their place in the indentation. The leading comment
// block (the file's header) and prose comments are not keys: a commented
// line counts as one only when its value is empty, one word, a quoted
// string or a flow collection ("# tail: what happens to ..." is prose).
func exampleKeys(text string) []exampleKey {
	keyRE := regexp.MustCompile(`^(\s*)(- )?([a-z][a-z0-9_]*):(?:\s+(.*))?$`)
	type level struct {
		col  int
		name string
	}
	var stack []level
	var keys []exampleKey
	header := true
	for i, line := range strings.Split(text, "\n") {
		trimmed := strings.TrimSpace(line)
		if trimmed == "" {
			continue
		}
		commented := strings.HasPrefix(trimmed, "#")
		if header {
			if commented {
				continue
			}
			header = false
		}
		if commented {
			at := strings.Index(line, "#")
			line = line[:at] + strings.TrimPrefix(line[at+1:], " ")
			if strings.HasPrefix(strings.TrimSpace(line), "#") {
				continue // a comment on a commented-out key
			}
		}
		m := keyRE.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		value := m[4]
		if strings.HasPrefix(value, "#") {
			value = ""
		} else if j := strings.Index(value, " #"); j >= 0 {
			value = value[:j]
		}
		value = strings.TrimSpace(value)
		if commented && strings.ContainsAny(value, " \t") && !strings.ContainsAny(value[:1], `[{"'`) {
			continue // prose
		}
		col := len(m[1]) + len(m[2])
		for len(stack) > 0 && stack[len(stack)-1].col >= col {
			stack = stack[:len(stack)-1]
		}
		path := m[3]
		if len(stack) > 0 {
			path = stack[len(stack)-1].name + "." + m[3]
		}
		stack = append(stack, level{col, path})
		keys = append(keys, exampleKey{path, i + 1})
	}
	return keys
}

// configPaths adds the dotted paths of the YAML keys of type t (a
// struct's, its inlined structs' included; a list's entries' through the
// list's key) to paths, and "PREFIX.*" for a mapping's free keys.
func configPaths(t reflect.Type, prefix string, paths map[string]bool) {
	for t.Kind() == reflect.Pointer || t.Kind() == reflect.Slice {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Map:
		paths[prefix+".*"] = true
	case reflect.Struct:
		var names []string
		fields := map[string]reflect.Type{}
		yamlFields(t, fields, &names)
		for _, n := range names {
			p := n
			if prefix != "" {
				p = prefix + "." + n
			}
			paths[p] = true
			configPaths(fields[n], p, paths)
		}
	}
}

// TestExampleConfigKeys: every key the example training configs name,
// set or commented out, is a key of Config at that place (a key renamed
// or removed in the code, or documented under the wrong section, fails);
// and examples/train.yaml, the reference, names every key of Config at
// its place (TestTrainExampleDocumentsEveryKey checks only that the word
// appears).
func TestExampleConfigKeys(t *testing.T) {
	paths := map[string]bool{}
	configPaths(reflect.TypeOf(Config{}), "", paths)
	files, err := filepath.Glob("../../examples/*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if filepath.Base(f) == "teacherd.yaml" {
			continue // serve.Config: cmd/teacherd's TestExampleConfigDocumentsEveryKey
		}
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		documented := map[string]bool{}
		for _, k := range exampleKeys(string(b)) {
			documented[k.path] = true
			parent, _, _ := cutLast(k.path)
			if !paths[k.path] && !paths[parent+".*"] {
				t.Errorf("%s:%d: %s is not a key of the training config (train/trainer.Config)", f, k.line, k.path)
			}
		}
		if filepath.Base(f) != "train.yaml" {
			continue
		}
		if len(documented) < 50 {
			t.Fatalf("%s: found %d keys: the parser lost them?", f, len(documented))
		}
		for p := range paths {
			if !strings.HasSuffix(p, ".*") && !documented[p] {
				t.Errorf("%s does not document the key %s (set, or commented out, under its section)", f, p)
			}
		}
	}
}

func cutLast(path string) (string, string, bool) {
	i := strings.LastIndex(path, ".")
	if i < 0 {
		return "", path, false
	}
	return path[:i], path[i+1:], true
}
