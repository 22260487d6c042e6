package redfence_test

import (
	"os"
	"strings"
	"testing"

	"github.com/redfence/redfence/service"
)

// TestREADME_RedisACL: the ACL user README gives operators is the one the
// service tests run against a real redis-server (service.RedisACL).
func TestREADME_RedisACL(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	want := "ACL SETUSER redfence on >PASSWORD " + service.RedisACL + "\n"
	if !strings.Contains(string(readme), want) {
		t.Errorf("README.md does not give the ACL user of service.RedisACL:\n%s", want)
	}
}
